"""scripts/bench_cluster.py's thread registry, imported by every Python process of a
benchmarked run (this folder on PYTHONPATH, $KNITTRANS_THREAD_LOG set): each
threading.Thread, as it starts, appends `tid, name, module of its target, module that
started it` to $KNITTRANS_THREAD_LOG/PID.tsv, so /proc/PID/task/TID can be attributed
to our code or to Ray's. Python before 3.14 gives its threads no OS name of their own
(they inherit the process's), so /proc/.../comm alone cannot tell them apart."""
import os
import sys
import threading

_DIR = os.environ.get("KNITTRANS_THREAD_LOG")
if _DIR:
  _bootstrap_inner, _start = threading.Thread._bootstrap_inner, threading.Thread.start

  def start(self):
    frame = sys._getframe(1)
    self._knittrans_creator = frame.f_globals.get("__name__", "?") if frame else "?"
    return _start(self)

  def bootstrap_inner(self):
    target = getattr(self, "_target", None)
    module = getattr(target, "__module__", None) or type(self).__module__
    try:
      with open(os.path.join(_DIR, f"{os.getpid()}.tsv"), "a") as f:
        f.write(f"{threading.get_native_id()}\t{self.name}\t{module}\t"
                f"{getattr(self, '_knittrans_creator', '?')}\n")
    except OSError:
      pass
    _bootstrap_inner(self)

  threading.Thread.start, threading.Thread._bootstrap_inner = start, bootstrap_inner

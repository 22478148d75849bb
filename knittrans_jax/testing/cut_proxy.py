"""A loopback TCP proxy in front of a server whose link can be cut and restored:
the network failure of an object store, with the server (and what it holds) kept.

    with CutProxy("http://127.0.0.1:9000") as proxy:   # proxy.endpoint: where to connect
      proxy.cut()      # open connections are shut, new ones are closed at once
      proxy.restore()  # connections go through again
"""
import socket
import threading
import urllib.parse


class CutProxy:

  def __init__(self, target: str):
    parsed = urllib.parse.urlsplit(target)
    if not parsed.hostname or not parsed.port:
      raise ValueError(f"CutProxy target {target!r} must be http://host:port")
    self._target = (parsed.hostname, parsed.port)
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
    self._lock = threading.Lock()
    self._open: set[socket.socket] = set()
    self._is_cut = False
    threading.Thread(target=self._accept, daemon=True).start()

  def cut(self) -> None:
    with self._lock:
      self._is_cut = True
      for s in self._open:
        _shut(s)

  def restore(self) -> None:
    with self._lock:
      self._is_cut = False

  def close(self) -> None:
    self.cut()
    _shut(self._listener)
    self._listener.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _accept(self) -> None:
    while True:
      try:
        client, _ = self._listener.accept()
      except OSError:
        return  # closed
      try:
        upstream = None if self._is_cut else socket.create_connection(self._target, timeout=10)
      except OSError:
        upstream = None
      with self._lock:
        if upstream is None or self._is_cut:
          _shut(client)
          client.close()
          if upstream is not None:
            upstream.close()
          continue
        upstream.settimeout(None)
        self._open |= {client, upstream}
      for src, dst in ((client, upstream), (upstream, client)):
        threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

  def _pump(self, src: socket.socket, dst: socket.socket) -> None:
    try:
      while data := src.recv(1 << 16):
        dst.sendall(data)
    except OSError:
      pass
    with self._lock:  # one side ended: end both (each pump closes its source)
      for s in (src, dst):
        _shut(s)
        self._open.discard(s)
    src.close()


def _shut(s: socket.socket) -> None:
  try:
    s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv, unlike close()
  except OSError:
    pass

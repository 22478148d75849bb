"""One of two jax.distributed processes (4 CPU devices each) loading a Hugging Face
checkpoint onto an 8-device fsdp mesh and saving it back (tests/test_hf_models.py)."""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

ckpt, port, pid, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import jax  # noqa: E402

from knittrans_jax.job import distributed  # noqa: E402

distributed.initialize(distributed.ProcessSetup(f"127.0.0.1:{port}", 2, pid))
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from knittrans_jax.mesh import MeshConfig, make_mesh  # noqa: E402
from knittrans_jax.models import hf  # noqa: E402

read = []  # bytes each callback returned: what this process read from the files
make = jax.make_array_from_callback


def counting(shape, sharding, cb):
  def wrapped(index):
    part = cb(index)
    read.append(part.nbytes)
    return part
  return make(shape, sharding, wrapped)


jax.make_array_from_callback = counting
mc = MeshConfig(axes=(("fsdp", -1),), rules=(("batch", "fsdp"), ("embed", "fsdp"),
                                              ("vocab", "fsdp")))
mesh = make_mesh(mc)
model, config = hf.load(ckpt, mesh=mesh, rules=mc.rules)
params = nnx.state(model, nnx.Param)
total = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(params))
full = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(params)]
hf.save(model, config, os.path.join(out, "export"))
with open(os.path.join(out, f"proc{pid}.json"), "w") as f:
  json.dump({"read": sum(read), "total": total, "devices": jax.device_count(),
             "checksum": float(sum(np.abs(a.astype(np.float64)).sum() for a in full))}, f)

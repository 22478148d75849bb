"""Moved to knittrans_jax/mesh.py (below models/, which load onto meshes). These names
stay here only until scripts/check_hf_parity.py and scripts/plan_layout.py import them
from there; then this module goes."""
from knittrans_jax.mesh import (MeshConfig, batch_size_multiple, logical_sharding,  # noqa: F401
                                logical_shardings, make_mesh, replicated)

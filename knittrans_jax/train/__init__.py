"""Training stack: train state, step functions, checkpoints; the mesh (knittrans_jax/mesh.py)
re-exported for the callers that build one beside a train state."""
from knittrans_jax.mesh import MeshConfig, make_mesh
from knittrans_jax.train.batch import BadBatchError, batch_shardings, check_batch, put_batch
from knittrans_jax.train.checkpoint import CheckpointConfig, Checkpointer
from knittrans_jax.train.optimizer import OptimizerConfig, make_optimizer
from knittrans_jax.train.state import TrainState, abstract_state, init_train_state
from knittrans_jax.train.step import StepFunctions, text_forward

__all__ = ["BadBatchError", "CheckpointConfig", "Checkpointer", "MeshConfig", "OptimizerConfig",
           "StepFunctions", "TrainState", "abstract_state", "batch_shardings", "check_batch",
           "init_train_state", "make_mesh", "make_optimizer", "put_batch", "text_forward"]

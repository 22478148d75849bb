"""TensorStore trajectory storage: units written by one producer each, read on demand."""
from knittrans_jax.storage.errors import (CorruptUnitError, SchemaMismatchError, StoreError,
                                          TrajectoryValidationError, UnknownUnitError)
from knittrans_jax.storage.images import Image, image_id
from knittrans_jax.storage.schema import StoreSchema
from knittrans_jax.storage.store import StoreWatcher, TrajectoryStore
from knittrans_jax.storage.unit_writer import UnitWriter

__all__ = ["CorruptUnitError", "Image", "SchemaMismatchError", "StoreError", "StoreSchema",
           "StoreWatcher", "TrajectoryStore", "TrajectoryValidationError", "UnitWriter",
           "UnknownUnitError", "image_id"]

"""A trajectory store: a root URL holding many storage units.

    store = TrajectoryStore.create("file:///tmp/store", StoreSchema(sources=("math",)))
    writer = store.writer("worker0")          # one producer per unit
    metas = writer.append(trajectories)       # atomic; returns metadata records
    payload = store.read(metas).result()      # on-demand, batched, asynchronous

Any TensorStore kvstore URL works unchanged: memory:// (one process), file://,
gs://, s3://. The root holds `store.json` (the schema) and `_units/NAME` markers
so units can be listed without listing their chunk keys.
"""
from __future__ import annotations

from typing import Sequence

import tensorstore as ts

from knittrans_jax.storage import layout as L
from knittrans_jax.storage.errors import (CorruptUnitError, SchemaMismatchError, StoreError,
                                          UnknownUnitError)
from knittrans_jax.storage.reads import ReadFuture
from knittrans_jax.storage.retention import publish_watermark, unit_bytes
from knittrans_jax.storage.schema import StoreSchema
from knittrans_jax.storage.unit_reader import UnitReader
from knittrans_jax.storage.unit_writer import UnitWriter
from knittrans_jax.types import TrajMeta

_SCHEMA_KEY = "store.json"
_REGISTRY = "_units/"


class TrajectoryStore:

  def __init__(self, url: str, schema: StoreSchema):
    if schema.token_chunk is None or schema.row_chunk is None:
      raise ValueError("a TrajectoryStore takes a schema with every field set: make one with "
                       "TrajectoryStore.create or .open, which choose the fields left None")
    self.url = L.normalize_root(url)
    self.schema = schema
    self._kv = L.open_kvstore(self.url, L.context(schema.durable))
    self._readers: dict[str, UnitReader] = {}

  @classmethod
  def create(cls, url: str, schema: StoreSchema) -> "TrajectoryStore":
    """Creates a store, or opens an existing one whose schema equals `schema` (its
    fields left None take the existing store's values)."""
    url = L.normalize_root(url)
    kv = L.open_kvstore(url, L.base_context())
    found = kv.read(_SCHEMA_KEY).result()
    if found.state == "value":
      existing = StoreSchema.from_json(found.value.decode())
      schema = schema.for_store(url, existing)
      if existing != schema:
        raise SchemaMismatchError(f"store {url} exists with schema {existing}, not {schema}")
    else:
      schema = schema.for_store(url)
      kv.write(_SCHEMA_KEY, schema.to_json()).result()
    return cls(url, schema)

  @staticmethod
  def exists(url: str) -> bool:
    kv = L.open_kvstore(L.normalize_root(url), L.base_context())
    return kv.read(_SCHEMA_KEY).result().state == "value"

  @classmethod
  def open(cls, url: str) -> "TrajectoryStore":
    url = L.normalize_root(url)
    kv = L.open_kvstore(url, L.base_context())
    found = kv.read(_SCHEMA_KEY).result()
    if found.state != "value":
      raise StoreError(f"no trajectory store at {url} ({_SCHEMA_KEY} missing)")
    try:
      schema = StoreSchema.from_json(found.value.decode())
    except Exception as e:
      raise StoreError(f"store {url}: {_SCHEMA_KEY} is unreadable: {e}") from e
    return cls(url, schema)

  def writer(self, unit: str, host: str | None = None, **options) -> UnitWriter:
    """Opens the unit for appending (creating it if new); resumes at its commit.
    `options`: UnitWriter's (reclaim_every_s)."""
    registered = self._kv.read(_REGISTRY + L.check_unit_name(unit)).result().state == "value"
    w = UnitWriter(self.url, unit, self.schema, host=host, registered=registered, **options)
    self._kv.write(_REGISTRY + unit, w.host).result()  # listed only once it is valid
    return w

  def units(self) -> list[str]:
    keys = self._kv.list(ts.KvStore.KeyRange(_REGISTRY, _REGISTRY[:-1] + "0")).result()
    return sorted(k.decode()[len(_REGISTRY):] for k in keys)

  def unit_host(self, unit: str) -> str:
    found = self._kv.read(_REGISTRY + unit).result()
    if found.state != "value":
      raise UnknownUnitError(unit, self.url)
    return found.value.decode()

  def reader(self, unit: str) -> UnitReader:
    if unit not in self._readers:
      if self._kv.read(_REGISTRY + L.check_unit_name(unit)).result().state != "value":
        raise UnknownUnitError(unit, self.url)
      self._readers[unit] = UnitReader(self.url, unit, self.schema)
    return self._readers[unit]

  def retain_from(self, unit: str, row: int) -> int:
    """Raises `unit`'s low watermark to `row` (storage/retention.py): its writer may
    reclaim every row below it. Only once a durable checkpoint records those rows'
    groups as retired. Returns the watermark now; a no-op (0) with retention 'all'."""
    if self.schema.retention == "all":
      return 0
    committed = self.reader(unit).commit().rows
    return publish_watermark(unit, L.join(self.url, unit), row, committed, self.schema.durable)

  def list_committed(self, unit: str | None = None, live: bool = False) -> list[TrajMeta]:
    """Metadata of every committed trajectory (of one unit, or of all units). A unit
    with reclaimed rows raises ReclaimedRowError, unless `live`: then each unit is
    listed from its low watermark (the rows it still holds)."""
    units = [unit] if unit is not None else self.units()
    return [m for u in units
            for m in self.reader(u).list(start=self.reader(u).watermark() if live else 0)]

  def footprint(self, files: bool = True) -> dict:
    """Rows committed and still held (at or above each unit's watermark) over all units,
    and (`files`) the bytes of their files, free pools included, on a `file://` store
    (else None)."""
    units = self.units()
    committed = sum(self.reader(u).commit().rows for u in units)
    held = committed - sum(self.reader(u).watermark() for u in units)
    local = files and self.url.startswith("file://")
    return {"rows_committed": committed, "rows_held": held,
            "bytes": sum(unit_bytes(L.join(self.url, u)) for u in units) if local else None}

  def committed_ids(self) -> set[str]:
    """The id of every row ever committed, the reclaimed ones included (their rows
    are below each unit's low watermark): what a run's accounting checks against."""
    return {f"{u}/{r}" for u in self.units() for r in range(self.reader(u).watermark())} | {
        m.id for m in self.list_committed(live=True)}

  def read(self, metas: Sequence[TrajMeta], skip_images=()) -> ReadFuture:
    """Starts reading the payloads of `metas`; returns at once. Images whose ids are
    in `skip_images` (already held by the caller) are not read. Without dedup
    (StoreSchema.dedup_images=False) every trajectory's own copy is read."""
    return ReadFuture(metas, self.reader, skip_images, self.schema.dedup_images)

  def watch(self) -> "StoreWatcher":
    return StoreWatcher(self)


class StoreWatcher:
  """Incremental listing for the controller: each poll returns newly committed rows.

  A unit that fails to read is reported in `failed` and skipped; the others go on.
  """

  def __init__(self, store: TrajectoryStore):
    self.store = store
    self.cursor: dict[str, int] = {}
    self.failed: dict[str, CorruptUnitError] = {}

  def poll(self) -> list[TrajMeta]:
    new = []
    for unit in self.store.units():
      if unit in self.failed:
        continue
      try:
        metas = self.store.reader(unit).list(start=self.cursor.get(unit, 0))
      except CorruptUnitError as e:
        self.failed[unit] = e
        continue
      self.cursor[unit] = self.cursor.get(unit, 0) + len(metas)
      new += metas
    return new

"""What a store holds and how it is laid out; fixed when the store is created."""
from __future__ import annotations

import dataclasses
import json

import gin


# Defaults of the fields chosen when a store is created (StoreSchema.for_store).
DIRECT_TOKEN_CHUNK, KVSTORE_TOKEN_CHUNK, ROW_CHUNK = 1 << 18, 1 << 15, 64
_CHOSEN_AT_CREATE = ("token_chunk", "row_chunk")
RETENTION = ("trained", "all")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class StoreSchema:
  """Per-store settings, saved in the store's root so every reader agrees.

  sources: names of the data sources; a trajectory of any other source is refused.
  max_prompt_len / max_response_len: longest sequences accepted on append.
  token_chunk: tokens per chunk of the `sequences` array (9 bytes each: id, log-prob,
    loss mask). None (the default) is chosen when the store is created: 262144
    (2.25 MiB chunk files) for a `file://` store without payload_checksum or durable,
    whose reads take just the bytes they need from each file and whose appends write
    just the new bytes (in place), so larger files only cut the files a read opens;
    32768 (288 KiB) otherwise, where every read fetches (and checks) whole chunks
    and every append rewrites the boundary chunk from its start, so both stay
    small (docs/storage.md, "Chunk sizes").
  row_chunk: rows per chunk of the per-trajectory columns; None: 64 for a new store.
    Each append rewrites the boundary chunk of these crc'd arrays whole (112 bytes a
    row of `rows`), so a smaller chunk is less to write per append (7 KB against 57
    KB at 512) and more files for a read of many rows' metadata (docs/storage.md,
    "Measured (issue 46)").
  image_chunk_bytes: bytes per chunk of the image table's data.
  payload_checksum: add a crc32c to every payload chunk (token arrays, images).
    Metadata (rows, image index, commit marker) is always checksummed. Truncated
    payload chunks are detected either way; this adds bit-flip detection at about
    30% lower read throughput.
  durable: fsync every write (survives power loss, slower appends: docs/storage.md). Without it
    the store is still safe against a killed process: the commit marker is
    written only after every other write of the append has completed.
  dedup_images: store each image once per unit, however many trajectories use it
    (the default). False stores a copy per trajectory (per image reference) and
    reads move each trajectory's own copy, as systems that ship an image with every
    trajectory do: for comparisons at equal bytes. Reads return the same arrays.
  retention: 'trained' (the default): a unit's rows below its low watermark, which the
    job raises once a durable checkpoint records their groups as retired, are
    reclaimed by the unit's writer, so the store stays the size of the work in
    flight (storage/retention.py). 'all': every row is kept, for replay and debugging
    (scripts/replay_check.py needs it).
  """
  sources: tuple[str, ...] = ("math", "code", "chat")
  max_prompt_len: int = 4096
  max_response_len: int = 8192
  token_chunk: int | None = None
  row_chunk: int | None = None
  image_chunk_bytes: int = 1 << 20
  payload_checksum: bool = False
  durable: bool = False
  dedup_images: bool = True
  retention: str = "trained"

  def __post_init__(self):
    object.__setattr__(self, "sources", tuple(self.sources))
    if not self.sources or len(set(self.sources)) != len(self.sources):
      raise ValueError(f"StoreSchema.sources must be non-empty and unique, got {self.sources!r}")
    for name in ("max_prompt_len", "max_response_len", "token_chunk", "row_chunk",
                 "image_chunk_bytes"):
      value = getattr(self, name)
      if value is None and name in _CHOSEN_AT_CREATE:
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"StoreSchema.{name} must be a positive int, got {value!r}")
    if not isinstance(self.dedup_images, bool):
      raise ValueError(f"StoreSchema.dedup_images must be a bool, got {self.dedup_images!r}")
    if self.retention not in RETENTION:
      raise ValueError(f"StoreSchema.retention must be one of {RETENTION}, got "
                       f"{self.retention!r}")

  def for_store(self, url: str, existing: "StoreSchema | None" = None) -> "StoreSchema":
    """This schema with the fields left None chosen: the existing store's values, or
    those for a new store at `url` (see token_chunk, row_chunk)."""
    direct = url.startswith("file://") and not self.payload_checksum and not self.durable
    new = {"token_chunk": DIRECT_TOKEN_CHUNK if direct else KVSTORE_TOKEN_CHUNK,
           "row_chunk": ROW_CHUNK}
    chosen = {name: getattr(existing, name) if existing is not None else new[name]
              for name in _CHOSEN_AT_CREATE if getattr(self, name) is None}
    return dataclasses.replace(self, **chosen) if chosen else self

  def source_index(self, source: str) -> int:
    return self.sources.index(source)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "StoreSchema":
    # A field missing from an older store.json takes its default (the old behaviour).
    fields = json.loads(text)
    fields["sources"] = tuple(fields["sources"])
    return cls(**fields)

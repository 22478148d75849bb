"""On-store layout of a storage unit: array names, columns, zarr3 specs, URLs.

A unit at `{root}/{unit}/` holds resizable-by-sparsity zarr3 arrays (shape 2**40,
chunks written on demand, so appends never rewrite array metadata):

  sequences                     uint8 jagged per-token payload, full sequence per
                                row: chunk k holds tokens [kC, (k+1)C) (C =
                                StoreSchema.token_chunk) as three planes, the
                                token ids (int32), then their log-probs (float32),
                                then their loss mask (uint8): 9 bytes per token
  rows                          int64 [rows, ROW_COLS] per-trajectory columns, the
                                reward among them (REWARD, its float64 bits)
  image_refs                    int64 jagged: image-table indices of each row
  turns                         int64 [turns, TURN_COLS] jagged: each episode row's
                                turns (response-token start, end, first and
                                last version)
  images/data                   uint8 jagged: raw image bytes, each image once
  images/index                  int64 [images, IMG_COLS]: byte end, dtype, shape
  images/hash                   uint8 [images, HASH_BYTES]: content hash (= id)
  commit                        int64 [COMMIT_LEN]: the commit marker

Beside them, two keys that are not arrays (storage/retention.py): `retain`, the low
watermark the controller writes, and `reclaimed`, what the writer has reclaimed
below it; each RETAIN_LEN int64s and their crc32c, one key each.

With StoreSchema.dedup_images (the default) the image table holds each image once
and `image_refs` of many rows point at it; without, every reference of every row
has its own row (its own copy) in the table.

This is format 6, the only one this version reads or writes. `rows` counts each
row's loss tokens (LOSS_TOKENS: the controller plans a mini-batch's loss normaliser
from metadata, job/work.py), an episode's turns (TURN_END into `turns`, where each
turn lies in the response and the versions that generated it) and its seconds
generating and in its environment (GEN_US, ENV_US), and the reward (REWARD). A unit
an older version wrote is refused by name, with its format and the last commit of
knittrans_jax that reads it (storage/commit.py, LAST_READER_OF): check that commit
out to read or convert the run. What each format changed: docs/storage.md, "Formats".

The commit marker holds the committed extent of every array and is written last,
as a single chunk (one key: replaced atomically by every kvstore driver; on a local
file system rewritten in place with one pwrite, storage/commit.py), so a reader that
reads it first sees only whole, committed rows.
"""
from __future__ import annotations

import os
import re

import numpy as np
import tensorstore as ts

from knittrans_jax.storage.schema import StoreSchema
from knittrans_jax.types import TurnSpan

FORMAT_VERSION = 6
READABLE_FORMATS = (6,)
# The last commit that reads each older format (refused here by name).
LAST_READER_OF = {1: "c68bd4c", 2: "c68bd4c", 3: "7efc00a", 4: "7efc00a", 5: "7efc00a"}
MAX_EXTENT = 1 << 40
HASH_BYTES = 16

# Columns of `rows`. End offsets make the arrays jagged: row r spans
# [end[r-1], end[r]) with end[-1] = 0.
(TOK_END, PROMPT_LEN, RESPONSE_LEN, SOURCE, GROUP_ID, INDEX_IN_GROUP, V_FIRST,
 V_LAST, REF_END, LOSS_TOKENS, TURN_END, GEN_US, ENV_US, REWARD) = range(14)


ROW_COLS = 14


def rows_reward(rows: np.ndarray) -> np.ndarray:
  """The rewards of `rows`: the REWARD column's bits as float64. A missing chunk's
  fill value (-1) reads as NaN."""
  return rows[:, REWARD].view(np.float64)


def rows_damaged(rows: np.ndarray) -> bool:
  """Whether `rows` hold values no writer stores: a negative integer column (the fill
  value of a missing chunk, or bytes written over) or a reward that is not finite.
  The reward's bits are a float's, negative for a negative reward."""
  if not rows.size:
    return False
  return bool(rows[:, :REWARD].min() < 0 or not np.isfinite(rows_reward(rows)).all())


# Columns of `turns`: response-token offsets [start, end) and versions of a turn.
TURN_START, TURN_STOP, TURN_V_FIRST, TURN_V_LAST = range(4)
TURN_COLS = 4


def turn_spans(table: np.ndarray, starts, counts) -> list[tuple[TurnSpan, ...]]:
  """Each row's turns: its slice [start, start + count) of rows of a `turns` table."""
  return [tuple(TurnSpan(*map(int, t)) for t in table[s:s + n]) for s, n in zip(starts, counts)]


# Columns of `images/index`.
IMG_BYTE_END, IMG_DTYPE, IMG_NDIM, IMG_DIM0 = 0, 1, 2, 3
IMG_MAX_NDIM = 4
IMG_COLS = IMG_DIM0 + IMG_MAX_NDIM

# Fields of the commit marker.
C_FORMAT, C_ROWS, C_TOKENS, C_REFS, C_IMAGES, C_IMAGE_BYTES, C_TURNS = range(7)
COMMIT_LEN = 8  # format 4 left fields 6 and 7 zero, so C_TURNS reads 0 there
# The retention records (storage/retention.py): one key each, replaced whole like
# the commit marker. A unit without them has reclaimed nothing.
RETAIN_LEN = 16

# Image dtypes the table accepts, by code.
IMAGE_DTYPES = (np.dtype(np.uint8), np.dtype(np.float32), np.dtype(np.float16),
                np.dtype(np.int32))

# Fill values are impossible for committed data, so a chunk file that went missing
# inside the committed range reads back as detectably invalid, not as silent zeros.
# The planar array's fill byte 255 reads as token -1, log-prob NaN and mask 255.
ROWS_FILL, SEQ_FILL = -1, 255

# The planes of `sequences`, in their order within a chunk.
SEQ_FIELDS = (("tokens", np.dtype(np.int32)), ("logprobs", np.dtype(np.float32)),
              ("loss_mask", np.dtype(np.uint8)))
SEQ_BYTES = sum(dt.itemsize for _, dt in SEQ_FIELDS)  # per token


def seq_plane_offsets(token_chunk: int) -> list[int]:
  """Byte offset of each plane (SEQ_FIELDS order) within a `sequences` chunk."""
  ends = np.cumsum([0] + [dt.itemsize * token_chunk for _, dt in SEQ_FIELDS])
  return [int(e) for e in ends[:-1]]


def sequences_damaged(tokens: np.ndarray, logprobs: np.ndarray, mask: np.ndarray) -> bool:
  """Whether sequences hold values no writer stores: the fill values (a chunk read
  back though missing) or bytes written over (a negative token, a NaN log-prob, a
  mask byte above 1). Reductions (NaN propagates through min) make no temporaries."""
  return bool(tokens.size) and bool(tokens.min() < 0 or np.isnan(logprobs.min())
                                    or mask.max() > 1)


PAYLOAD_ARRAYS = ("sequences",)  # the arrays that hold the sequences
# The arrays a reader opens only once the commit marker says the unit is of this
# format (an older unit's differ: refused by its marker, not by a failed open).
FORMAT_ARRAYS = ("rows", "turns")

_UNIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

# One shared context per durability setting. The child inherits the parent's
# memory kvstore, so a `memory://` store is the same store for every opener in the
# process whatever its schema says.
_BASE_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
_DURABLE_CONTEXT = ts.Context({"file_io_sync": True}, _BASE_CONTEXT)
_FAST_CONTEXT = ts.Context({"file_io_sync": False}, _BASE_CONTEXT)


def context(durable: bool) -> ts.Context:
  return _DURABLE_CONTEXT if durable else _FAST_CONTEXT


def base_context() -> ts.Context:
  return _BASE_CONTEXT


RESERVED_NAMES = ("store.json",)


def check_unit_name(name: str) -> str:
  if not isinstance(name, str) or not _UNIT_NAME.match(name) or name in RESERVED_NAMES:
    raise ValueError(f"unit name {name!r} must match {_UNIT_NAME.pattern} and not be one of "
                     f"{RESERVED_NAMES}")
  return name


def join(url: str, *parts: str) -> str:
  """Joins a kvstore URL (memory://, file://, gs://, s3://...) with path parts.

  The result ends with '/', which TensorStore reads as a directory-like prefix.
  """
  url = normalize_root(url)
  return url + "".join(p.strip("/") + "/" for p in parts)


def normalize_root(url: str) -> str:
  """The URL with exactly one trailing '/' (the scheme's own slashes kept)."""
  scheme, sep, path = url.partition("://")
  if not sep or not scheme:
    raise ValueError(f"store URL {url!r} needs a scheme, e.g. file:///tmp/store or memory://name")
  path = path.rstrip("/")
  if scheme == "file":
    path = "/" + path.lstrip("/")  # file:/// keeps its absolute root
  if path in ("", "/"):
    return f"{scheme}://{path}"  # the kvstore's root: memory:// or file:///
  return f"{scheme}://{path}/"


def kvstore(url: str) -> str | dict:
  """The TensorStore kvstore spec of a store URL: the URL itself, except for s3://.

  TensorStore's s3 driver takes its endpoint and region only from the spec, so an
  s3:// URL becomes a spec here, from the environment variables the AWS tools read:
  AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (an S3-compatible server: MinIO, moto),
  AWS_REGION or AWS_DEFAULT_REGION, AWS_MAX_ATTEMPTS (retries of a failed request).
  Every process that gets the URL and inherits the environment reaches the same
  server. Credentials come from the environment when AWS_ACCESS_KEY_ID is set, else
  from TensorStore's default AWS chain (~/.aws, instance metadata).
  """
  scheme, _, rest = url.partition("://")
  if scheme != "s3":
    return url
  bucket, _, path = rest.partition("/")
  if not bucket:
    raise ValueError(f"store URL {url!r}: an s3 URL needs a bucket, e.g. s3://bucket/path")
  spec = {"driver": "s3", "bucket": bucket, "path": path}
  env = os.environ
  endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
  region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
  if endpoint:
    spec["endpoint"] = endpoint
    region = region or "us-east-1"  # signatures need one; S3-compatible servers ignore it
  if region:
    spec["aws_region"] = region
  if env.get("AWS_ACCESS_KEY_ID"):
    spec["aws_credentials"] = {"type": "environment"}
  if env.get("AWS_MAX_ATTEMPTS"):
    attempts = env["AWS_MAX_ATTEMPTS"]
    if not attempts.isdigit() or int(attempts) < 1:
      raise ValueError(f"AWS_MAX_ATTEMPTS={attempts!r} must be a positive integer")
    spec["s3_request_retries"] = {"max_retries": int(attempts)}
  return spec


def open_kvstore(url: str, context: ts.Context) -> ts.KvStore:
  return ts.KvStore.open(kvstore(url), context=context).result()


def _codecs(checksum: bool) -> list[dict]:
  codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
  if checksum:
    codecs.append({"name": "crc32c"})
  return codecs


def array_spec(url: str, dtype: str, shape: list[int], chunk: list[int], fill,
               checksum: bool) -> dict:
  return {
      "driver": "zarr3",
      "kvstore": kvstore(url),
      "metadata": {
          "shape": shape,
          "data_type": dtype,
          "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
          "chunk_key_encoding": {"name": "default"},
          "fill_value": fill,
          "codecs": _codecs(checksum),
      },
  }


def unit_arrays(unit_url: str, schema: StoreSchema) -> dict[str, dict]:
  """The zarr3 spec of every array of a unit, by name."""
  tc, rc, pay = schema.token_chunk, schema.row_chunk, schema.payload_checksum
  M = MAX_EXTENT
  j = lambda name: join(unit_url, name)
  payload = {"sequences": array_spec(j("sequences"), "uint8", [M], [SEQ_BYTES * tc],
                                     SEQ_FILL, pay)}
  return {
      **payload,
      "rows": array_spec(j("rows"), "int64", [M, ROW_COLS], [rc, ROW_COLS], ROWS_FILL, True),
      "image_refs": array_spec(j("image_refs"), "int64", [M], [rc], ROWS_FILL, True),
      "images/data": array_spec(j("images/data"), "uint8", [M], [schema.image_chunk_bytes],
                                0, pay),
      "images/index": array_spec(j("images/index"), "int64", [M, IMG_COLS], [rc, IMG_COLS],
                                 ROWS_FILL, True),
      "images/hash": array_spec(j("images/hash"), "uint8", [M, HASH_BYTES], [rc, HASH_BYTES],
                                0, True),
      "commit": array_spec(j("commit"), "int64", [COMMIT_LEN], [COMMIT_LEN], 0, True),
      "turns": array_spec(j("turns"), "int64", [M, TURN_COLS], [rc, TURN_COLS], ROWS_FILL,
                          True),
  }


def open_unit_arrays(unit_url: str, schema: StoreSchema, create: bool,
                     names=None) -> dict[str, ts.TensorStore]:
  """Opens (optionally creating) the arrays of a unit (all, or those in `names`),
  concurrently."""
  ctx = context(schema.durable)
  specs = unit_arrays(unit_url, schema)
  futures = {name: ts.open(spec, create=create, open=True, context=ctx)
             for name, spec in specs.items() if names is None or name in names}
  return {name: f.result() for name, f in futures.items()}

"""TensorBoard scalar event files, written directly.

tensorboardX imports torch whenever torch is installed (its writer module does, at
import), which added 1.8 s to every job process's start. A run only logs
scalars, and the format for those is small: a TFRecord file of `Event` protos.

  record:  uint64 length | uint32 masked crc32c(length) | data | uint32 masked crc32c(data)
  Event:   wall_time (1, double), step (2, int64), file_version (3, string), summary (5)
  Summary: value (1, repeated) -> Value: tag (1, string), simple_value (2, float)
"""
from __future__ import annotations

import os
import socket
import struct
import time

import google_crc32c


def _masked_crc(data: bytes) -> int:
  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # int64 on the wire: a negative step is ten bytes, as protobuf writes it
  out = bytearray()
  while True:
    low, n = n & 0x7F, n >> 7
    out.append(low | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # a length-delimited field (wire type 2)
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int, *, file_version: str | None = None, tag: str | None = None,
           value: float | None = None) -> bytes:
  out = b"\x09" + struct.pack("<d", time.time()) + b"\x10" + _varint(step)
  if file_version is not None:
    out += _field(3, file_version.encode())
  if tag is not None:
    val = _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
    out += _field(5, _field(1, val))
  return out


class ScalarWriter:
  """`add_scalar(tag, value, step)` into DIR/events.out.tfevents.<time>.<host>.<pid>, flushed
  every `flush_every_s`, on `flush` and on `close`, as tensorboardX's SummaryWriter."""

  def __init__(self, logdir: str, flush_every_s: float = 10.0):
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    self.flush_every_s = flush_every_s
    self._file = open(self.path, "wb")
    self._flushed = time.monotonic()
    self._write(_event(0, file_version="brain.Event:2"))
    self.flush()

  def _write(self, data: bytes) -> None:
    length = struct.pack("<Q", len(data))
    self._file.write(length + struct.pack("<I", _masked_crc(length)) + data
                     + struct.pack("<I", _masked_crc(data)))

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    self._write(_event(int(step), tag=tag, value=float(value)))
    if time.monotonic() - self._flushed > self.flush_every_s:
      self.flush()

  def flush(self) -> None:
    self._file.flush()
    self._flushed = time.monotonic()

  def close(self) -> None:
    if not self._file.closed:
      self._file.close()

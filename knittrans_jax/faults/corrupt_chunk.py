"""A truncated, deleted or zeroed payload chunk in one unit: reads name the unit,
the unit is quarantined, its rows outside the damaged chunk and every other unit
are still read, intact, once."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from knittrans_jax.faults.accounting import Outcome
from knittrans_jax.faults.data import SCHEMA, group, mismatches
from knittrans_jax.storage import TrajectoryStore
from knittrans_jax.storage import layout as L
from knittrans_jax.storage.quarantine import QuarantiningReader

ARRAYS = L.PAYLOAD_ARRAYS  # chunk k: tokens [kC, (k+1)C) of the unit
DAMAGE = ("truncate", "delete", "garbage")


def damage_chunk(store_url: str, unit: str, array: str, index: int, damage: str) -> None:
  """Truncates, deletes or overwrites the head of one chunk of a unit's array, through
  the kvstore, so the same damage is done on every backend (file, s3...)."""
  kv = L.open_kvstore(L.join(store_url, unit, array), L.base_context())
  key = f"c/{index}"
  if damage == "delete":
    del kv[key]
    return
  data = kv[key]
  if damage == "truncate":
    kv[key] = data[:len(data) // 2]
  else:
    kv[key] = b"\xff" * min(64, len(data)) + data[64:]


def run(root: str, trials: int = 6, seed: int = 11, n: int = 4, units: int = 3,
        groups: int = 24, micro: int = 16, store_url: str | None = None) -> Outcome:
  """`store_url`: the stores live under it (default file://ROOT)."""
  rng = np.random.default_rng(seed)
  schema = dataclasses.replace(SCHEMA, token_chunk=512)  # several chunks per unit
  out = Outcome("corrupt or truncated chunk in one unit")
  for t in range(trials):
    base = L.join(store_url or f"file://{os.path.abspath(root)}", f"trial{t}", "store")
    store = TrajectoryStore.create(base, schema)
    for u in range(units):
      w = store.writer(f"u{u}")
      for g in range(groups):
        w.append(group(seed, u * groups + g, n))
    victim = f"u{int(rng.integers(units))}"
    array = ARRAYS[int(rng.integers(len(ARRAYS)))]
    damage = DAMAGE[int(rng.integers(len(DAMAGE)))]
    metas = store.list_committed()
    victim_tokens = max(m.token_end for m in metas if m.unit == victim)
    index = int(rng.integers(victim_tokens // schema.token_chunk))  # a full chunk
    damage_chunk(base, victim, array, index, damage)
    lo, hi = index * schema.token_chunk, (index + 1) * schema.token_chunk
    damaged = {m.id for m in metas if m.unit == victim and m.token_start < hi and m.token_end > lo}
    reader = QuarantiningReader(TrajectoryStore.open(store.url))
    order = list(rng.permutation(len(metas)))  # consumers read in admission order, not by unit
    got, wrong = [], []
    for k in range(0, len(order), micro):
      payload = reader.read([metas[i] for i in order[k:k + micro]])
      wrong += mismatches(payload, seed, n)
      got += [m.id for m in payload.metas]
    out.trials += 1
    out.written += len(metas)
    out.trained += len(got) - len(wrong)
    out.duplicated += len(got) - len(set(got))
    out.quarantined += len(reader.bad_rows)
    # Lost: an undamaged row not read back intact; or damage that went unnoticed.
    intact = set(got) - set(wrong)
    out.lost += sum(m.id not in intact for m in metas if m.id not in damaged)
    out.lost += len(set(wrong))
    if victim not in reader.quarantined or set(reader.quarantined) != {victim}:
      out.errors.append(f"trial {t}: quarantined {sorted(reader.quarantined)}, damaged {victim}")
    else:
      out.errors.append(reader.quarantined[victim][:160])
    if not set(reader.bad_rows) <= damaged:
      out.errors.append(f"trial {t}: rows outside the damaged chunk were set aside")
  return out

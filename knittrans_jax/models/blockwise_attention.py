"""Blockwise (flash-style) causal attention for the training forward, packed rows included.

Softmax attention computed one [block, block] tile at a time with a running maximum
and sum (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), under a custom
VJP that keeps only the output and each query's log-sum-exp and recomputes the tiles
in the backward pass. No [heads, T, T] array exists, forward or backward: memory is
O(T) per head where the masked einsum (layers.Attention, 'einsum') holds T^2 scores,
28 GiB a row for Qwen2.5-7B's 28 heads at 16,384 tokens. Tiles above the diagonal are
skipped (a loop of i + 1 key tiles for query tile i), so it computes half the scores.

Pure JAX: it runs, and is tested against the masked einsum, on CPU, GPU and TPU alike;
a fused kernel (cuDNN, splash attention) is faster where the backend has one
(docs/training.md, "Attention for long packed rows").

Masking is the decoder's: query t attends to key s <= t where `valid[s]` and, in a
packed row, `segment_ids[t] == segment_ids[s]`. A query with no key to attend to
(padding in a packed row) averages the values it sees, as the masked einsum's
uniform softmax does over its row; nothing reads those positions.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RowMask(NamedTuple):
  """The causal mask as the per-token facts it comes from (never [T, T]):
  valid [B, T] bool, segment_ids [B, T] int or None (one sequence a row)."""
  valid: jax.Array
  segment_ids: jax.Array | None

  def dense(self) -> jax.Array:
    """[B, T, T] True where attending is allowed: the masked path's mask."""
    T = self.valid.shape[1]
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & self.valid[:, None, :]
    if self.segment_ids is not None:
      mask = mask & (self.segment_ids[:, :, None] == self.segment_ids[:, None, :])
    return mask


def attention(q, k, v, mask: RowMask, block: int = 512):
  """q [B, T, H, D], k and v [B, T, KV, D] (H a multiple of KV) -> [B, T, H, D]."""
  B, T, H, D = q.shape
  KV = k.shape[2]
  if k.shape != (B, T, KV, D) or v.shape != k.shape or H % KV:
    raise ValueError(f"blockwise attention: q {q.shape}, k {k.shape}, v {v.shape} do not match")
  blk = min(block, T)
  pad = -T % blk
  seg = (jnp.zeros((B, T), jnp.int32) if mask.segment_ids is None
         else mask.segment_ids.astype(jnp.int32))
  valid = mask.valid.astype(bool)
  if pad:  # padded keys are invalid; padded queries are cut off below
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    valid = jnp.pad(valid, ((0, 0), (0, pad)))
    seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
  n = (T + pad) // blk
  # Tiles first: [n, B, blk, ...], so a loop indexes tile i with one dynamic slice.
  qb = q.reshape(B, n, blk, KV, H // KV, D).swapaxes(0, 1)
  kb, vb = (x.reshape(B, n, blk, KV, D).swapaxes(0, 1) for x in (k, v))
  vtile, stile = valid.reshape(B, n, blk).swapaxes(0, 1), seg.reshape(B, n, blk).swapaxes(0, 1)
  out = _flash(qb, kb, vb, vtile, stile)  # [n, B, blk, KV, G, D]
  return out.swapaxes(0, 1).reshape(B, n * blk, H, D)[:, :T]


def _neg(dtype):
  return jnp.finfo(dtype).min


def _tile_mask(i, j, vtile, stile):
  """[B, blk, blk]: query tile i against key tile j."""
  blk = vtile.shape[-1]
  ar = jnp.arange(blk)
  causal = (j * blk + ar[None, :]) <= (i * blk + ar[:, None])
  same = stile[i][:, :, None] == stile[j][:, None, :]
  return causal[None] & vtile[j][:, None, :] & same


def _scores(qb, kb, vtile, stile, i, j):
  """Scaled, masked scores of tile (i, j), float32: [B, KV, G, blk, blk]."""
  scale = qb.shape[-1] ** -0.5
  s = jnp.einsum("bqkgd,bskd->bkgqs", qb[i], kb[j], preferred_element_type=jnp.float32) * scale
  m = _tile_mask(i, j, vtile, stile)[:, None, None]
  return jnp.where(m, s, _neg(jnp.float32))


def _forward(qb, kb, vb, vtile, stile):
  """Output [n, B, blk, KV, G, D] and log-sum-exp [n, B, KV, G, blk]."""
  n, B, blk, KV, G, D = qb.shape

  def query_tile(i):
    def key_tile(j, carry):
      o, mx, l = carry
      s = _scores(qb, kb, vtile, stile, i, j)
      new = jnp.maximum(mx, s.max(-1))
      p = jnp.exp(s - new[..., None])
      corr = jnp.exp(mx - new)
      o = o * corr[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vb.dtype), vb[j],
                                           preferred_element_type=jnp.float32)
      return o, new, l * corr + p.sum(-1)

    init = (jnp.zeros((B, KV, G, blk, D), jnp.float32),
            jnp.full((B, KV, G, blk), _neg(jnp.float32)), jnp.zeros((B, KV, G, blk), jnp.float32))
    o, mx, l = jax.lax.fori_loop(0, i + 1, key_tile, init)  # causal: tiles j <= i only
    return (o / l[..., None]).transpose(0, 3, 1, 2, 4).astype(qb.dtype), mx + jnp.log(l)

  return jax.lax.map(query_tile, jnp.arange(n))


@jax.custom_vjp
def _flash(qb, kb, vb, vtile, stile):
  return _forward(qb, kb, vb, vtile, stile)[0]


def _flash_fwd(qb, kb, vb, vtile, stile):
  out, lse = _forward(qb, kb, vb, vtile, stile)
  return out, (qb, kb, vb, vtile, stile, out, lse)


def _flash_bwd(res, dout):
  qb, kb, vb, vtile, stile, out, lse = res
  n = qb.shape[0]
  scale = qb.shape[-1] ** -0.5
  do = dout.transpose(0, 1, 3, 4, 2, 5).astype(jnp.float32)  # [n, B, KV, G, blk, D]
  o = out.transpose(0, 1, 3, 4, 2, 5).astype(jnp.float32)
  delta = jnp.sum(do * o, -1)  # [n, B, KV, G, blk]: the softmax VJP's row term

  def probs_and_dscores(i, j):
    p = jnp.exp(_scores(qb, kb, vtile, stile, i, j) - lse[i][..., None])
    dp = jnp.einsum("bkgqd,bskd->bkgqs", do[i], vb[j].astype(jnp.float32))
    return p, p * (dp - delta[i][..., None])

  def dq_tile(i):  # query tile i over key tiles j <= i
    def body(j, acc):
      _, ds = probs_and_dscores(i, j)
      return acc + jnp.einsum("bkgqs,bskd->bqkgd", ds, kb[j].astype(jnp.float32))
    return jax.lax.fori_loop(0, i + 1, body, jnp.zeros(qb.shape[1:], jnp.float32)) * scale

  def dkv_tile(j):  # key tile j over query tiles i >= j
    def body(i, acc):
      dk, dv = acc
      p, ds = probs_and_dscores(i, j)
      dv = dv + jnp.einsum("bkgqs,bkgqd->bskd", p, do[i])
      dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qb[i].astype(jnp.float32))
      return dk, dv
    zero = jnp.zeros(kb.shape[1:], jnp.float32)
    dk, dv = jax.lax.fori_loop(j, n, body, (zero, zero))
    return dk * scale, dv

  dq = jax.lax.map(dq_tile, jnp.arange(n))
  dk, dv = jax.lax.map(dkv_tile, jnp.arange(n))
  return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)

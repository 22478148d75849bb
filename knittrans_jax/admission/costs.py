"""What an admission rule gives up, measured per run (issue 60): how far the trained
source mix strays from the quotas, and whether training favours problems that finish
fast (the tail bias that dropping stale groups brings, tinker-cookbook PR #822).

Both read records any run keeps, simulated or real:
  quota_error(mini_batches, spec)   mini_batches: (k, j, {source: groups}) per step
  tail_bias(groups)                 groups: (source, seconds to finish or None, fate)
where a fate is 'trained', a drop reason ('stale', 'zero_signal', ...) or 'pending'
(still in flight or waiting when the run ended: undecided, left out of the shares).

Quota error, per train batch k (its M mini-batches, counted once all M trained):
L1 = sum_s |c_s - q_s| / G, 0 exactly when the batch meets every quota, 2 at most;
the worst source is the largest |c_s - q_s| / G. Per mini-batch, against the quota's
share: sum_s |c_s / g - q_s / G|. Without quotas there is nothing to miss: None.

Tail bias, over groups whose fate is decided and whose generation finished: the share
trained per source and per decile of time to finish (dispatch to last response), and
the mean time to finish of the trained groups against all of them: a ratio under 1
means training saw the fast problems more often than they were asked.
"""
from __future__ import annotations

import collections
from typing import Iterable, Mapping, Sequence

import numpy as np

from knittrans_jax.admission.spec import TrainBatchSpec


def _stats(x: Sequence[float]) -> dict:
  return {"mean": float(np.mean(x)), "max": float(np.max(x))} if len(x) else {
      "mean": None, "max": None}


def quota_error(mini_batches: Iterable[tuple[int, int, Mapping[str, int]]],
                spec: TrainBatchSpec) -> dict | None:
  """{'mean', 'max'} of the per-train-batch L1, 'worst_source' {'mean', 'max', 'by_source'
  (how often each source was the worst)}, 'mini_batch' {'mean', 'max'} and
  'train_batches' (complete ones counted); None without quotas."""
  quota = spec.source_quota
  if quota is None:
    return None
  G, g, M = spec.groups_per_batch, spec.mini_batch_groups, spec.num_mini_batches
  per_batch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
  steps: collections.Counter = collections.Counter()
  mb_l1 = []
  for k, _, counts in mini_batches:
    per_batch[k].update(counts)
    steps[k] += 1
    names = set(quota) | set(counts)
    mb_l1.append(sum(abs(counts.get(s, 0) / g - quota.get(s, 0) / G) for s in names))
  l1, worst, worst_src = [], [], collections.Counter()
  for k, counts in sorted(per_batch.items()):
    if steps[k] < M:
      continue  # a train batch the run did not finish
    err = {s: abs(counts.get(s, 0) - quota.get(s, 0)) / G for s in set(quota) | set(counts)}
    l1.append(sum(err.values()))
    top = max(sorted(err), key=err.get)
    worst.append(err[top])
    if err[top] > 0:
      worst_src[top] += 1
  return {**_stats(l1), "worst_source": {**_stats(worst), "by_source": dict(worst_src)},
          "mini_batch": _stats(mb_l1), "train_batches": len(l1)}


def tail_bias(groups: Iterable[tuple[str, float | None, str]], deciles: int = 10) -> dict:
  """Shares trained per source and per time-to-finish decile, mean times to finish of
  trained and of all decided groups, and the counts (module doc)."""
  groups = list(groups)
  fates = collections.Counter(f for _, _, f in groups)
  done = [(s, float(t), f) for s, t, f in groups
          if f != "pending" and t is not None and np.isfinite(t)]
  out = {"dispatched": len(groups), "decided": len(done), "fates": dict(fates)}
  if not done:
    return {**out, "trained_share": None, "by_source": {}, "by_decile": [],
            "gen_s_mean_trained": None, "gen_s_mean_decided": None, "gen_s_ratio": None}
  t = np.asarray([x for _, x, _ in done])
  trained = np.asarray([f == "trained" for _, _, f in done])
  src = np.asarray([str(s) for s, _, _ in done])
  by_source = {str(s): float(trained[src == s].mean()) for s in sorted(set(src))}
  # Decile edges of the decided groups' times; a group on an edge goes to the lower bin.
  edges = np.quantile(t, np.linspace(0, 1, deciles + 1))
  which = np.clip(np.searchsorted(edges, t, side="left") - 1, 0, deciles - 1)
  by_decile = []
  for d in range(deciles):
    sel = which == d
    by_decile.append({"decile": d, "upper_s": float(edges[d + 1]), "groups": int(sel.sum()),
                      "trained_share": float(trained[sel].mean()) if sel.any() else None})
  mean_trained = float(t[trained].mean()) if trained.any() else None
  return {**out, "trained_share": float(trained.mean()), "by_source": by_source,
          "by_decile": by_decile, "gen_s_mean_trained": mean_trained,
          "gen_s_mean_decided": float(t.mean()),
          "gen_s_ratio": None if mean_trained is None else mean_trained / float(t.mean())}

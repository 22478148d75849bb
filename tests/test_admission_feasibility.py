"""The closed-form count check equals brute force; the spec refuses what can never work."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans_jax.admission import InfeasibleSpecError, TrainBatchSpec
from knittrans_jax.admission import feasibility as F


def brute_residual(residual, slots, g, bounds):
  """Is there a slots x S matrix, rows summing to g within bounds, columns = residual?"""
  sources = list(residual)
  rows = [r for r in itertools.product(*[range(bounds[s][0], bounds[s][1] + 1) for s in sources])
          if sum(r) == g]
  reach = {tuple([0] * len(sources))}
  for _ in range(slots):
    reach = {tuple(a + b for a, b in zip(acc, r)) for acc in reach for r in rows}
  return tuple(residual[s] for s in sources) in reach


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_count_intervals_admit_exactly_the_counts_that_leave_a_feasible_residual(data):
  """The closed form (*) behind count_intervals, against brute force: a count vector
  x (sum g) is within every [a_s, b_s] iff x is within the bounds and the residual
  needed - x fills the slots_left - 1 later mini-batches."""
  S = data.draw(st.integers(1, 3))
  g = data.draw(st.integers(1, 4))
  slots_left = data.draw(st.integers(1, 4))
  sources = [f"s{i}" for i in range(S)]
  bounds = {}
  for s in sources:
    lo = data.draw(st.integers(0, g))
    bounds[s] = (lo, data.draw(st.integers(lo, g)))
  if not sum(b[0] for b in bounds.values()) <= g <= sum(b[1] for b in bounds.values()):
    return  # the spec refuses such bounds (tested below)
  # What the train batch still needs adds up to slots_left * g, so only the bounds decide.
  total = slots_left * g
  cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=S - 1, max_size=S - 1)))
  needed = dict(zip(sources, [b - a for a, b in zip([0] + cuts, cuts + [total])]))
  intervals = F.count_intervals(needed, {s: total for s in sources}, slots_left,
                                bounds.__getitem__)
  for x in itertools.product(range(g + 1), repeat=S):
    if sum(x) != g:
      continue
    admitted = all(intervals[s][0] <= c <= intervals[s][1] for s, c in zip(sources, x))
    brute = (all(bounds[s][0] <= c <= bounds[s][1] for s, c in zip(sources, x))
             and brute_residual({s: needed[s] - c for s, c in zip(sources, x)},
                                slots_left - 1, g, bounds))
    assert admitted == brute, (needed, slots_left, bounds, x, intervals)


def test_spec_defaults_and_gin():
  import gin
  gin.parse_config("TrainBatchSpec.group_size = 4\nTrainBatchSpec.groups_per_batch = 8\n"
                   "TrainBatchSpec.num_mini_batches = 2\n"
                   "TrainBatchSpec.source_quota = {'math': 6, 'code': 2}")
  spec = TrainBatchSpec()
  assert spec.mini_batch_groups == 4 and spec.quota("code") == 2 and spec.bounds("math") == (0, 4)


BASE = dict(group_size=4, groups_per_batch=8, num_mini_batches=2)
INFEASIBLE = [
    (dict(groups_per_batch=10, num_mini_batches=4), "not divisible"),
    (dict(group_size=0), "group_size = 0"),
    (dict(source_quota={"a": 5, "b": 2}), "sums to 7"),
    (dict(source_quota={"a": 9, "b": -1}), r"source_quota\['b'\] = -1"),
    (dict(source_quota={}), "empty"),
    (dict(mini_batch_bounds={"a": (3, 2)}), "min <= max"),
    (dict(mini_batch_bounds={"a": (5, 6)}), "exceeds the mini-batch size"),
    (dict(mini_batch_bounds={"a": (3, 4), "b": (2, 4)}), "minimums sum to 5"),
    (dict(source_quota={"a": 2, "b": 6}, mini_batch_bounds={"a": (2, 4)}), "needs 4 groups"),
    (dict(source_quota={"a": 2, "b": 6}, mini_batch_bounds={"b": (0, 2)}), "cannot fit"),
    (dict(source_quota={"a": 8}, mini_batch_bounds={"c": (1, 2)}), r"source_quota\['c'\] = 0"),
    (dict(mini_batch_bounds={"a": (1, "x")}), "pair of ints"),
    (dict(mini_batch_token_budget=15), "cannot hold g = 4 groups"),
    (dict(mini_batch_token_budget=0), "positive int"),
    (dict(max_staleness=-1), "max_staleness"),
]


@pytest.mark.parametrize("changes,message", INFEASIBLE)
def test_infeasible_specs_are_refused_with_the_reason(changes, message):
  with pytest.raises(InfeasibleSpecError, match=message):
    TrainBatchSpec(**{**BASE, **changes})

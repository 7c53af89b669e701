"""`plan_pairs`: pairs packed whole, against a naive first-fit-decreasing of the pair units
(written without segpack), over random length distributions; the shared-prefix layout; the
refusal and the truncation of pairs longer than a row."""

import numpy as np
import pytest

from segpack.packing import pairs as pairs_lib
from support.packing_oracles import naive_ffd


def _random(rng, n, seq_len):
  shape = rng.choice(["uniform", "long_prompts", "lognormal"])
  if shape == "uniform":
    p = rng.integers(1, seq_len // 4, n)
  elif shape == "long_prompts":
    p = rng.integers(seq_len // 8, seq_len // 3, n)
  else:
    p = np.clip(rng.lognormal(3, 1, n).astype(int), 1, seq_len // 3)
  c = p + rng.integers(1, seq_len // 6, n)
  r = p + rng.integers(1, seq_len // 6, n)
  return c, r, p


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shared", [False, True])
def test_every_pair_is_placed_once_whole_in_one_row_as_naive_ffd_places_units(seed, shared):
  rng = np.random.default_rng(seed)
  seq_len = int(rng.choice([64, 256, 1024]))
  c, r, p = _random(rng, int(rng.integers(1, 300)), seq_len)
  pp = pairs_lib.plan_pairs(chosen_lengths=c, rejected_lengths=r, prompt_lengths=p,
                            seq_len=seq_len, shared_prefix=shared)
  plan = pp.plan
  s = np.where(p >= 2, p - 1, 0) if shared else np.zeros_like(p)
  units = c + r - s
  # The rows are naive FFD's bins of the units, bin for bin.
  rows = [sorted(set(pp.pair[plan.row_splits[i]:plan.row_splits[i + 1]].tolist()))
          for i in range(plan.num_rows)]
  assert sorted(map(sorted, naive_ffd(units.tolist(), seq_len))) == sorted(rows)
  seen = np.zeros(len(c), int)
  for i in range(plan.num_rows):
    lo, hi = plan.row_splits[i], plan.row_splits[i + 1]
    assert plan.length[lo:hi].astype(int).sum() <= seq_len
    for k in set(pp.pair[lo:hi].tolist()):
      seen[k] += 1
      mine = np.flatnonzero(pp.pair[lo:hi] == k) + lo
      roles = pp.role[mine].tolist()
      assert roles == ([0, 1, 2] if s[k] else [1, 2])  # prompt once, then the two branches
      doc, start, length = plan.doc[mine], plan.start[mine], plan.length[mine].astype(int)
      assert doc.tolist() == ([2 * k] if s[k] else []) + [2 * k, 2 * k + 1]
      # The pieces cover each sequence exactly once (the prompt shared, branches after it).
      assert start[-2] + length[-2] == c[k] and start[-1] + length[-1] == r[k]
      assert start[-2] == start[-1] == s[k]
  assert (seen == 1).all()
  assert pp.stats["kept"] == len(c) and pp.stats["slots_saved"] == int(s.sum())


def test_a_pair_longer_than_a_row_is_refused_by_name_or_truncated_and_counted():
  c, r, p = np.array([10, 90, 30]), np.array([12, 70, 20]), np.array([4, 50, 25])
  with pytest.raises(pairs_lib.PairTooLongError, match=r"pair 1 \(documents 2, 3\) needs 160 "
                                                       r"slots.*1 pair\(s\) do not fit"):
    pairs_lib.plan_pairs(chosen_lengths=c, rejected_lengths=r, prompt_lengths=p, seq_len=64)
  pp = pairs_lib.plan_pairs(chosen_lengths=c, rejected_lengths=r, prompt_lengths=p, seq_len=64,
                            truncate=True)
  assert pp.stats["truncated"] == 0 and pp.stats["dropped"] == 1  # 50 prompt slots: no room
  assert sorted(set(pp.pair.tolist())) == [0, 2]
  pp = pairs_lib.plan_pairs(chosen_lengths=c, rejected_lengths=r, prompt_lengths=np.array(
      [4, 10, 25]), seq_len=64, truncate=True)
  assert pp.stats["truncated"] == 1 and pp.stats["dropped"] == 0
  mine = pp.pair == 1
  assert pp.plan.length[mine].astype(int).sum() <= 64 and (pp.plan.start[mine] == 0).all()
  assert (pp.plan.length[mine] == 32).all()  # keep-start: both cut to their first 32 slots

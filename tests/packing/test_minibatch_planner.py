"""Tests for segpack.packing.minibatch_planner: the minibatch planner, against naive loops written out
here (the documented permutation, a slot-by-slot chunk walk, textbook first fit and FFD)."""

import numpy as np
import pytest

from support.packing_oracles import naive_bfd
from segpack.packing import LongDocs
from segpack.packing.minibatch_planner import MinibatchConfigError, MinibatchPlanner


def naive_chunks(n, seq_len, extra, overlap, long_docs):
  v, start, out = n + extra, 0, []
  while True:
    out.append((start, min(seq_len, v - start)))
    if start + seq_len >= v or long_docs == "truncate":
      return out
    start += seq_len - overlap


def naive_ffd_rows(pieces, seq_len):
  rows, room = [], []
  for p in sorted(pieces, key=lambda p: -p[2]):  # a stable sort: ties keep their order
    for r in range(len(rows)):
      if room[r] >= p[2]:
        rows[r].append(p)
        room[r] -= p[2]
        break
    else:
      rows.append([p])
      room.append(seq_len - p[2])
  return rows


def perm(n, seed, epoch):
  return np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(n)


def planner(lengths, *, long_docs="split", min_len=0, overlap=0, **kw):
  """A `MinibatchPlanner`; `long_docs` is the mode, as the naive oracle takes it."""
  args = dict(seq_len=16, strategy="ffd", extra_tokens=2, seed=3, shuffle=True,
              examples_per_batch=None, tokens_per_batch=None, drop_remainder=False,
              long_docs=LongDocs(mode=long_docs, overlap=overlap, min_len=min_len))
  args.update(kw)
  return MinibatchPlanner(lengths, **args)


def batch_rows(ep, rows_per_batch):
  p = ep.plan
  return [[p.row(r) for r in range(b * rows_per_batch, (b + 1) * rows_per_batch)]
          for b in range(ep.num_batches)]


def lengths_case(seed=0, n=45):
  lengths = np.random.default_rng(seed).integers(1, 30, n)
  lengths[5] = 50  # longer than a row: split
  return lengths


@pytest.mark.parametrize("n, k, drop, overlap, long_docs", [
    (45, 4, False, 0, "split"), (45, 7, True, 3, "split"), (45, 6, False, 0, "truncate"),
    (45, 45, False, 0, "split"), (700, 350, False, 0, "split")])  # > 256 chunks: the run path
def test_examples_per_batch_are_permutation_slices_packed_by_textbook_ffd(n, k, drop, overlap,
                                                                          long_docs):
  lengths = lengths_case(n=n)
  mp = planner(lengths, examples_per_batch=k, drop_remainder=drop, overlap=overlap,
               long_docs=long_docs)
  for epoch in range(2):
    order = perm(len(lengths), 3, epoch)
    ep = mp.plan(epoch)
    stop = len(order) - len(order) % k if drop else len(order)
    batches = [order[a:min(a + k, stop)] for a in range(0, stop, k)]
    assert ep.num_batches == len(batches)
    width = int(ep.rows_needed.max())
    for b, (members, rows) in enumerate(zip(batches, batch_rows(ep, width))):
      assert ep.examples[ep.batch_examples[b]:ep.batch_examples[b + 1]].tolist() == list(members)
      pieces = [(d, s, n) for d in members.tolist()
                for s, n in naive_chunks(int(lengths[d]), 16, 2, overlap, long_docs)]
      want = naive_ffd_rows(pieces, 16)
      assert ep.rows_needed[b] == len(want)
      assert rows == want + [[]] * (width - len(want))  # padded with empty rows


def test_token_budget_batches_are_greedy_runs_placed_first_fit():
  lengths = lengths_case(1, 60)
  mp = planner(lengths, tokens_per_batch=100)  # 6 rows of 16
  ep = mp.plan(0)
  # Naive: consecutive examples while all their chunks fit first-fit into the 6 rows.
  want, rows, room, members = [], [[] for _ in range(6)], [16] * 6, []
  for d in perm(len(lengths), 3, 0).tolist():
    chunks = naive_chunks(int(lengths[d]), 16, 2, 0, "split")
    for attempt in range(2):
      trial, placed = list(room), []
      for s, n in chunks:
        r = next((r for r in range(6) if trial[r] >= n), None)
        if r is None:
          break
        trial[r] -= n
        placed.append((r, (d, s, n)))
      if len(placed) == len(chunks):
        break
      want.append((members, [x for x in rows if x]))
      rows, room, members = [[] for _ in range(6)], [16] * 6, []
    room = trial
    for r, piece in placed:
      rows[r].append(piece)
    members.append(d)
  want.append((members, [x for x in rows if x]))
  assert ep.num_batches == len(want)
  width = int(ep.rows_needed.max())
  for b, ((members, rows), got) in enumerate(zip(want, batch_rows(ep, width))):
    assert ep.examples[ep.batch_examples[b]:ep.batch_examples[b + 1]].tolist() == members
    assert got[:len(rows)] == rows and not any(got[len(rows):])


def test_pad_and_other_strategies():
  lengths = lengths_case(2)
  pad = planner(lengths, examples_per_batch=5, strategy="pad", shuffle=False).plan(0)
  assert pad.plan.num_pieces == int(pad.rows_needed.sum())  # one chunk per row
  bfd = planner(lengths, examples_per_batch=5, strategy="bfd", shuffle=False).plan(0)
  width = int(bfd.rows_needed.max())
  for b, rows in enumerate(batch_rows(bfd, width)):
    members = list(range(5 * b, min(5 * b + 5, len(lengths))))
    pieces = [(d, s, n) for d in members
              for s, n in naive_chunks(int(lengths[d]), 16, 2, 0, "split")]
    want = [[pieces[i] for i in row] for row in naive_bfd([p[2] for p in pieces], 16)]
    assert rows[:len(want)] == want


def test_row_bound_plan_fields_and_errors():
  lengths = lengths_case(3)
  mp = planner(lengths, examples_per_batch=4, strategy="pad", min_len=3)
  kept = [d for d in range(len(lengths)) if lengths[d] >= 3]
  assert mp.examples.tolist() == kept
  counts = sorted((len(naive_chunks(int(lengths[d]), 16, 2, 0, "split")) for d in kept),
                  reverse=True)
  assert mp.row_bound() == sum(counts[:4])
  assert all(int(mp.plan(e).rows_needed.max()) <= mp.row_bound() for e in range(5))
  ep = mp.plan(0, rows_per_batch=mp.row_bound())
  assert ep.plan.num_rows == ep.num_batches * mp.row_bound()
  assert (ep.plan.seq_len, ep.plan.extra_tokens, ep.plan.strategy) == (16, 2, "pad")
  empty = mp.empty_plan()
  assert empty.num_rows == 0 and (empty.seq_len, empty.extra_tokens) == (16, 2)
  with pytest.raises(MinibatchConfigError, match=r"epoch 0 batch \d+ needs \d+ rows but "
                                                 r"rows_per_batch=1"):
    mp.plan(0, rows_per_batch=1)
  with pytest.raises(MinibatchConfigError, match="tokens_per_batch=8 is less than seq_len=16"):
    planner(lengths, tokens_per_batch=8)
  with pytest.raises(MinibatchConfigError, match="min_len=99"):
    planner(lengths, examples_per_batch=2, min_len=99)

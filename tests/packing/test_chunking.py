"""Tests for segpack.packing.chunking: cutting documents into chunks, against a naive slot walk."""

import numpy as np
import pytest

from support.packing_oracles import naive_chunks
from segpack import packing
from segpack.packing import LongDocs
from segpack.packing.chunking import chunk_counts, chunk_spans, make_chunks
from segpack.packing.minibatch_planner import MinibatchPlanner


def _random_case(rng):
  seq_len = int(rng.choice([1, 2, 5, 16, 33]))
  extra = int(rng.integers(0, min(3, seq_len)))
  overlap = int(rng.integers(0, seq_len))
  mode = str(rng.choice(packing.LONG_DOC_MODES))
  lengths = rng.integers(0, 5 * seq_len + 3, int(rng.integers(1, 60)))
  return lengths, seq_len, dict(long_docs=mode, overlap=overlap, extra_tokens=extra)


def library(kw, min_len=0):
  """The oracle's keywords (`long_docs` a mode, `overlap`) as the library takes them."""
  return dict(long_docs=LongDocs(mode=kw["long_docs"], overlap=kw["overlap"], min_len=min_len),
              extra_tokens=kw["extra_tokens"])


def test_chunk_spans_and_counts_equal_the_naive_walk():
  rng = np.random.default_rng(0)
  for _ in range(300):
    lengths, seq_len, kw = _random_case(rng)
    naive = naive_chunks(lengths.tolist(), seq_len, **kw)
    for d, n in enumerate(lengths.tolist()):
      want = [(s, m) for doc, s, m in naive if doc == d]
      assert chunk_spans(n, seq_len, **library(kw)) == want, (n, seq_len, kw)
    counts = chunk_counts(lengths, seq_len, **library(kw))
    assert counts.dtype == np.int64
    assert counts.tolist() == [sum(doc == d for doc, _, _ in naive) for d in range(len(lengths))]


def test_make_chunks_equals_the_naive_walk():
  rng = np.random.default_rng(1)
  for _ in range(300):
    lengths, seq_len, kw = _random_case(rng)
    min_len = int(rng.integers(0, 4))
    naive = naive_chunks(lengths.tolist(), seq_len, min_len=min_len, **kw)
    c = make_chunks(lengths, seq_len, **library(kw, min_len))
    doc = np.arange(len(c.length)) if c.doc is None else c.doc
    start = np.zeros(len(c.length), np.int64) if c.start is None else c.start
    assert list(zip(doc.tolist(), start.tolist(), c.length.tolist())) == naive
    assert c.stats["chunks"] == len(naive)
    assert c.stats["tokens"] == sum(m for _, _, m in naive)


def test_docstring_examples():
  kw = dict(long_docs=LongDocs(mode="split", overlap=2), extra_tokens=2)
  assert chunk_counts(np.array([0, 6, 7, 18]), 8, **kw).tolist() == [1, 1, 2, 3]
  assert chunk_spans(18, 8, **kw) == [(0, 8), (6, 8), (12, 8)]
  assert chunk_spans(18, 8, long_docs=LongDocs(mode="truncate", overlap=2),
                     extra_tokens=2) == [(0, 8)]
  assert chunk_spans(0, 8) == [] and chunk_counts(np.array([0, 0]), 8).tolist() == [0, 0]


@pytest.mark.parametrize("overlap", [0, 3])
def test_minibatch_planner_cuts_the_same_chunks(overlap):
  lengths = np.random.default_rng(2).integers(1, 70, 50)
  planner = MinibatchPlanner(lengths, seq_len=16, strategy="pad",
                             long_docs=LongDocs(overlap=overlap), extra_tokens=2, seed=0,
                             shuffle=False, examples_per_batch=50, tokens_per_batch=None,
                             drop_remainder=False)
  p = planner.plan(0).plan
  got = list(zip(p.doc.tolist(), p.start.tolist(), p.length.tolist()))
  assert got == naive_chunks(lengths.tolist(), 16, overlap=overlap, extra_tokens=2)


def test_split_covers_every_slot_exactly_once_without_overlap():
  rng = np.random.default_rng(3)
  lengths = rng.integers(0, 200, 500)
  p = packing.plan(lengths, 17, strategy="ffd", extra_tokens=2)
  covered = [np.zeros(n + 2, np.int64) for n in lengths]
  for d, s, n in zip(p.doc, p.start, p.length):
    covered[d][s:s + n] += 1
  assert all(np.all(c == 1) for c in covered)
  assert p.stats["split"] == int(np.sum(lengths + 2 > 17))


def test_split_with_overlap_covers_everything_and_overlaps_exactly():
  rng = np.random.default_rng(4)
  seq_len, overlap = 16, 5
  lengths = rng.integers(1, 120, 300)
  p = packing.plan(lengths, seq_len, strategy="bfd", long_docs=LongDocs(overlap=overlap),
                   extra_tokens=1)
  pieces = {}
  for d, s, n in zip(p.doc.tolist(), p.start.tolist(), p.length.tolist()):
    pieces.setdefault(d, []).append((s, n))
  for d, chunks in pieces.items():
    chunks.sort()
    v = int(lengths[d]) + 1
    assert chunks[0][0] == 0
    assert chunks[-1][0] + chunks[-1][1] == v  # the last chunk reaches the end
    for (s0, n0), (s1, n1) in zip(chunks, chunks[1:]):
      assert s0 + n0 - s1 == overlap  # consecutive chunks share exactly `overlap` slots
      assert n0 == seq_len  # only the last chunk is short
      assert s1 + n1 > s0 + n0  # and every chunk brings new slots
    covered = np.zeros(v, bool)
    for s, n in chunks:
      covered[s:s + n] = True
    assert covered.all()


def test_truncate_keeps_only_the_first_row_of_long_documents():
  lengths = np.array([3, 40, 10, 100, 9])
  p = packing.plan(lengths, 10, strategy="ffd", long_docs=LongDocs(mode="truncate"),
                   extra_tokens=1)
  got = sorted(zip(p.doc.tolist(), p.start.tolist(), p.length.tolist()))
  assert got == [(0, 0, 4), (1, 0, 10), (2, 0, 10), (3, 0, 10), (4, 0, 10)]
  assert p.stats["truncated"] == 3 and p.stats["split"] == 0
  assert p.stats["dropped_tokens"] == (41 - 10) + (11 - 10) + (101 - 10)


def test_min_len_drops_short_documents():
  lengths = np.array([5, 1, 0, 7, 2, 3])
  p = packing.plan(lengths, 8, long_docs=LongDocs(min_len=3))
  assert sorted(set(p.doc.tolist())) == [0, 3, 5]
  assert p.stats["dropped"] == 3 and p.stats["documents"] == 6
  # Without extra tokens, empty documents have nothing to pack and are dropped too.
  p = packing.plan(np.array([0, 4, 0]), 8)
  assert p.doc.tolist() == [1] and p.stats["dropped"] == 2
  # With BOS/EOS an empty document still has its two slots.
  p = packing.plan(np.array([0, 4, 0]), 8, extra_tokens=2)
  assert sorted(p.doc.tolist()) == [0, 1, 2]

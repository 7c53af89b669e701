"""Tests of segpack.packing: exactness against naive textbook planners, chunking, cache, errors."""

import os

import numpy as np
import pytest

from segpack import packing
from segpack.packing import cache as cache_mod
from segpack.packing import planner as planner_mod


# ---------------------------------------------------------------------------------------------
# Independent oracles: one item at a time, O(items x bins), straight from the textbook.


def naive_chunks(lengths, seq_len, *, long_docs="split", min_len=0, overlap=0, extra_tokens=0):
  """[(doc, start, length)] in document order, built slot by slot."""
  out = []
  for d, n in enumerate(lengths):
    if n < min_len:
      continue
    v = n + extra_tokens
    if v == 0:
      continue
    start = 0
    while True:
      out.append((d, start, min(seq_len, v - start)))
      if start + seq_len >= v or long_docs == "truncate":
        break
      start += seq_len - overlap
  return out


def naive_ffd(sizes, cap):
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  room, bins = [], []
  for i in order:
    for b, r in enumerate(room):
      if r >= sizes[i]:
        room[b] -= sizes[i]
        bins[b].append(i)
        break
    else:
      room.append(cap - sizes[i])
      bins.append([i])
  return bins


def naive_bfd(sizes, cap):
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  room, bins = [], []
  for i in order:
    best = None
    for b, r in enumerate(room):
      if r >= sizes[i] and (best is None or r < room[best]):
        best = b
    if best is None:
      room.append(cap - sizes[i])
      bins.append([i])
    else:
      room[best] -= sizes[i]
      bins[best].append(i)
  return bins


def naive_next_fit(sizes, cap):
  bins, used = [], cap + 1
  for i, s in enumerate(sizes):
    if used + s > cap:
      bins.append([])
      used = 0
    bins[-1].append(i)
    used += s
  return bins


NAIVE = {"ffd": naive_ffd, "bfd": naive_bfd, "greedy": naive_next_fit,
         "pad": lambda sizes, cap: [[i] for i in range(len(sizes))],
         "sorted_pad": lambda sizes, cap: [[i] for i in
                                           sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))]}


def plan_rows(p):
  """The plan as [[(doc, start, length), ...] per row]."""
  return [p.row(r) for r in range(p.num_rows)]


def random_lengths(rng, n, seq_len):
  kind = rng.integers(4)
  if kind == 0:  # lognormal, some longer than a row
    return np.round(rng.lognormal(np.log(seq_len / 4), 1.0, n)).astype(np.int64)
  if kind == 1:  # few distinct lengths: long runs of equal sizes
    return rng.choice(rng.integers(1, seq_len + 1, 4), n)
  if kind == 2:  # uniform up to twice a row
    return rng.integers(0, 2 * seq_len, n)
  return rng.integers(1, max(2, seq_len // 3), n)  # many small


# ---------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("strategy", sorted(NAIVE))
def test_planner_equals_naive_oracle(strategy):
  rng = np.random.default_rng(1234)
  for trial in range(150):
    seq_len = int(rng.choice([4, 7, 16, 33, 64, 100]))
    n = int(rng.integers(1, 120 if trial % 5 else 600))
    lengths = random_lengths(rng, n, seq_len)
    extra = int(rng.integers(0, min(3, seq_len)))
    overlap = int(rng.integers(0, seq_len)) if rng.random() < 0.3 else 0
    long_docs = "truncate" if rng.random() < 0.2 else "split"
    min_len = int(rng.integers(0, 3))
    chunks = naive_chunks(lengths.tolist(), seq_len, long_docs=long_docs, min_len=min_len,
                          overlap=overlap, extra_tokens=extra)
    if not chunks:
      continue
    expected = [[chunks[i] for i in b]
                for b in NAIVE[strategy]([c[2] for c in chunks], seq_len)]
    got = packing.plan(lengths, seq_len, strategy=strategy, long_docs=long_docs,
                       min_len=min_len, overlap=overlap, extra_tokens=extra)
    assert plan_rows(got) == expected, (trial, seq_len, lengths.tolist())
    assert got.num_rows == len(expected)


@pytest.mark.parametrize("strategy", ["ffd", "bfd"])
def test_decreasing_planners_equal_oracle_on_medium_inputs(strategy):
  rng = np.random.default_rng(99)
  for _ in range(3):
    seq_len = 512
    lengths = np.round(rng.lognormal(np.log(100) - 0.5, 1.0, 3000)).astype(np.int64)
    chunks = naive_chunks(lengths.tolist(), seq_len, extra_tokens=2)
    expected = [[chunks[i] for i in b]
                for b in NAIVE[strategy]([c[2] for c in chunks], seq_len)]
    assert plan_rows(packing.plan(lengths, seq_len, strategy=strategy, extra_tokens=2)) == expected

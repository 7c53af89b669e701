"""Tests of segpack.packing: exactness against naive textbook planners, chunking, cache, errors."""

import os

import numpy as np
import pytest

from segpack import packing
from segpack.packing import cache as cache_mod


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


# ---------------------------------------------------------------------------------------------
# Invariants of every plan


def check_plan_invariants(p, lengths, *, extra_tokens, overlap, long_docs, min_len):
  seq_len = p.seq_len
  assert p.row_splits[0] == 0 and p.row_splits[-1] == p.num_pieces
  assert np.all(np.diff(p.row_splits) >= 1)
  assert np.all(p.row_lengths() <= seq_len)
  assert np.all((p.length >= 1) & (p.length <= seq_len))
  # Every chunk of the naive chunking appears exactly once.
  expected = sorted(naive_chunks(list(lengths), seq_len, long_docs=long_docs, min_len=min_len,
                                 overlap=overlap, extra_tokens=extra_tokens))
  got = sorted(zip(p.doc.tolist(), p.start.tolist(), p.length.tolist()))
  assert got == expected


@pytest.mark.parametrize("strategy", sorted(packing.STRATEGIES))
def test_every_chunk_placed_once_and_rows_fit(strategy):
  rng = np.random.default_rng(7)
  for _ in range(40):
    seq_len = int(rng.integers(3, 80))
    lengths = random_lengths(rng, int(rng.integers(1, 300)), seq_len)
    extra = int(rng.integers(0, min(3, seq_len)))
    overlap = int(rng.integers(0, seq_len))
    long_docs = str(rng.choice(packing.LONG_DOCS))
    if not np.any(lengths + extra > 0):
      continue
    p = packing.plan(lengths, seq_len, strategy=strategy, extra_tokens=extra, overlap=overlap,
                     long_docs=long_docs)
    check_plan_invariants(p, lengths, extra_tokens=extra, overlap=overlap,
                          long_docs=long_docs, min_len=0)
    assert p.stats["tokens"] == int(p.length.sum())
    assert p.stats["rows"] == p.num_rows


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
  p = packing.plan(lengths, seq_len, strategy="bfd", overlap=overlap, extra_tokens=1)
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
  p = packing.plan(lengths, 10, strategy="ffd", long_docs="truncate", extra_tokens=1)
  got = sorted(zip(p.doc.tolist(), p.start.tolist(), p.length.tolist()))
  assert got == [(0, 0, 4), (1, 0, 10), (2, 0, 10), (3, 0, 10), (4, 0, 10)]
  assert p.stats["truncated"] == 3 and p.stats["split"] == 0
  assert p.stats["dropped_tokens"] == (41 - 10) + (11 - 10) + (101 - 10)


def test_min_len_drops_short_documents():
  lengths = np.array([5, 1, 0, 7, 2, 3])
  p = packing.plan(lengths, 8, min_len=3)
  assert sorted(set(p.doc.tolist())) == [0, 3, 5]
  assert p.stats["dropped"] == 3 and p.stats["documents"] == 6
  # Without extra tokens, empty documents have nothing to pack and are dropped too.
  p = packing.plan(np.array([0, 4, 0]), 8)
  assert p.doc.tolist() == [1] and p.stats["dropped"] == 2
  # With BOS/EOS an empty document still has its two slots.
  p = packing.plan(np.array([0, 4, 0]), 8, extra_tokens=2)
  assert sorted(p.doc.tolist()) == [0, 1, 2]


def test_utilization_and_lower_bound():
  rng = np.random.default_rng(5)
  lengths = np.round(rng.lognormal(np.log(200) - 0.5, 1.0, 20000)).astype(np.int64)
  for strategy in ("ffd", "bfd"):
    p = packing.plan(lengths, 1024, strategy=strategy, extra_tokens=2)
    assert p.stats["lower_bound"] == -(-int((lengths + 2).sum()) // 1024)
    assert p.num_rows <= 1.001 * p.stats["lower_bound"]
  pad = packing.plan(lengths, 1024, strategy="pad", extra_tokens=2)
  srt = packing.plan(lengths, 1024, strategy="sorted_pad", extra_tokens=2, batch_size=8,
                     pad_multiple=64)
  greedy = packing.plan(lengths, 1024, strategy="greedy", extra_tokens=2)
  assert pad.stats["utilization"] < srt.stats["utilization"] <= 1.0
  assert greedy.stats["utilization"] < p.stats["utilization"]


def test_sorted_pad_slots_follow_the_batch_definition():
  lengths = np.array([2, 9, 7, 3, 30])  # virtual lengths with seq_len 16: 2, 9, 7, 3, 16, 14
  p = packing.plan(lengths, 16, strategy="sorted_pad", batch_size=2, pad_multiple=4)
  assert p.length.tolist() == [16, 14, 9, 7, 3, 2]
  # Batches (16, 14) -> 16 slots, (9, 7) -> 12, (3, 2) -> 4: 2 * (16 + 12 + 4) slots.
  assert p.stats["slots"] == 64
  assert p.stats["utilization"] == pytest.approx(51 / 64)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("kwargs, needle", [
    (dict(lengths=[3, 4], seq_len=2, extra_tokens=2), "seq_len=2"),
    (dict(lengths=[3, 4], seq_len=8, strategy="best"), "'best'"),
    (dict(lengths=[], seq_len=8), "lengths is empty"),
    (dict(lengths=[3, -1, 4], seq_len=8), "lengths[1] = -1"),
    (dict(lengths=[3, 4], seq_len=8, overlap=8), "overlap=8"),
    (dict(lengths=[3, 4], seq_len=8, overlap=-1), "overlap=-1"),
    (dict(lengths=[3, 4], seq_len=8, long_docs="drop"), "'drop'"),
    (dict(lengths=[3, 4], seq_len=0), "seq_len=0"),
    (dict(lengths=[3, 4], seq_len=8, min_len=-2), "min_len=-2"),
    (dict(lengths=[1.5, 2.0], seq_len=8), "float64"),
    (dict(lengths=[[1, 2]], seq_len=8), "1-D"),
    (dict(lengths=[1, 2], seq_len=8, min_len=5), "min_len=5"),
    (dict(lengths=[1, 2], seq_len=8, strategy="sorted_pad", batch_size=0), "batch_size=0"),
])
def test_bad_arguments_name_the_argument_and_value(kwargs, needle):
  kwargs = dict(kwargs)
  lengths = kwargs.pop("lengths")
  seq_len = kwargs.pop("seq_len")
  with pytest.raises(ValueError) as err:
    packing.plan(np.asarray(lengths), seq_len, **kwargs)
  assert needle in str(err.value)
  assert isinstance(err.value, packing.PackingArgumentError)


def test_unknown_strategy_lists_the_valid_ones():
  with pytest.raises(ValueError) as err:
    packing.plan(np.array([1, 2]), 8, strategy="nope")
  for name in packing.STRATEGIES:
    assert repr(name) in str(err.value)


# ---------------------------------------------------------------------------------------------
# Save / load and the cache


def test_save_and_load_round_trip(tmp_path):
  p = packing.plan(np.arange(1, 50), 16, strategy="bfd", overlap=2, extra_tokens=2)
  p.save(tmp_path / "plan")
  p.save(tmp_path / "plan")  # replacing an existing plan works
  q = packing.Plan.load(tmp_path / "plan", mmap=True)
  assert isinstance(q.doc, np.memmap)
  for name in ("row_splits", "doc", "start", "length"):
    np.testing.assert_array_equal(getattr(p, name), getattr(q, name))
  assert (q.seq_len, q.overlap, q.extra_tokens, q.strategy) == (16, 2, 2, "bfd")
  assert q.stats == p.stats
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary left over


def test_load_errors_name_the_file(tmp_path):
  with pytest.raises(packing.PlanError, match="plan.json"):
    packing.Plan.load(tmp_path / "missing")
  p = packing.plan(np.arange(1, 10), 16)
  p.save(tmp_path / "plan")
  os.remove(tmp_path / "plan" / "doc.npy")
  with pytest.raises(packing.PlanError, match="doc.npy"):
    packing.Plan.load(tmp_path / "plan")


def test_cache_second_call_loads_instead_of_planning(tmp_path, monkeypatch):
  lengths = np.random.default_rng(0).integers(1, 100, 1000)
  first = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="fp-1", extra_tokens=2)

  def boom(*args, **kwargs):
    raise AssertionError("planned again instead of loading the cache")

  monkeypatch.setattr(cache_mod._planner, "plan", boom)
  second = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="fp-1", extra_tokens=2)
  assert isinstance(second.doc, np.memmap)
  np.testing.assert_array_equal(first.doc, second.doc)
  np.testing.assert_array_equal(first.row_splits, second.row_splits)
  # Another key (changed shards) must plan again.
  with pytest.raises(AssertionError, match="planned again"):
    packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="fp-2", extra_tokens=2)


def test_cache_key_changes_with_every_parameter():
  base = dict(strategy="ffd", long_docs="split", min_len=0, overlap=0, extra_tokens=0)
  keys = {packing.plan_key("fp", 64, **base), packing.plan_key("fp2", 64, **base),
          packing.plan_key("fp", 128, **base)}
  for name, value in (("strategy", "bfd"), ("long_docs", "truncate"), ("min_len", 1),
                      ("overlap", 1), ("extra_tokens", 2)):
    keys.add(packing.plan_key("fp", 64, **{**base, name: value}))
  assert len(keys) == 8
  sp = dict(base, strategy="sorted_pad")
  assert (packing.plan_key("fp", 64, **sp, batch_size=4)
          != packing.plan_key("fp", 64, **sp, batch_size=8))


def test_cache_without_key_hashes_the_lengths(tmp_path):
  a = packing.load_or_plan(np.array([5, 6, 7]), 16, cache_dir=tmp_path)
  b = packing.load_or_plan(np.array([5, 6, 8]), 16, cache_dir=tmp_path)
  assert a.length.tolist() != b.length.tolist()
  assert len(os.listdir(tmp_path)) == 2


def test_corrupt_cache_is_replanned(tmp_path):
  lengths = np.arange(1, 17)
  packing.load_or_plan(lengths, 16, cache_dir=tmp_path, key="k")
  (entry,) = os.listdir(tmp_path)
  (tmp_path / entry / "plan.json").write_text("{not json")
  p = packing.load_or_plan(lengths, 16, cache_dir=tmp_path, key="k")
  assert p.num_pieces == 16
  packing.Plan.load(tmp_path / entry)  # repaired on disk


# ---------------------------------------------------------------------------------------------
# Larger inputs against per-item oracles that are fast enough for thousands of bins


def tree_ffd(sizes, cap):
  """First fit, one item at a time, with a max segment tree over bins (leftmost room >= s)."""
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  size = 1
  while size < len(sizes):
    size *= 2
  tree = [-1] * (2 * size)  # room of bin b at leaf size + b; -1 = not open
  bins, num_bins = [], 0
  for i in order:
    s = sizes[i]
    if tree[1] >= s:
      node = 1
      while node < size:
        node = 2 * node if tree[2 * node] >= s else 2 * node + 1
      b = node - size
      bins[b].append(i)
    else:
      b, num_bins = num_bins, num_bins + 1
      bins.append([i])
      node = size + b
      tree[node] = cap
    tree[size + b] -= s
    node = (size + b) // 2
    while node:
      tree[node] = max(tree[2 * node], tree[2 * node + 1])
      node //= 2
  return bins


def bisect_bfd(sizes, cap):
  """Best fit, one item at a time, with a sorted list of (room, bin)."""
  import bisect
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  rooms, bins = [], []
  for i in order:
    s = sizes[i]
    j = bisect.bisect_left(rooms, (s, -1))
    if j < len(rooms):
      room, b = rooms.pop(j)
      bins[b].append(i)
    else:
      room, b = cap, len(bins)
      bins.append([i])
    bisect.insort(rooms, (room - s, b))
  return bins


def test_per_item_oracles_agree_with_the_naive_loops():
  rng = np.random.default_rng(11)
  for _ in range(30):
    sizes = rng.integers(1, 20, int(rng.integers(1, 200))).tolist()
    assert tree_ffd(sizes, 20) == naive_ffd(sizes, 20)
    assert bisect_bfd(sizes, 20) == naive_bfd(sizes, 20)


@pytest.mark.parametrize("strategy, oracle", [("ffd", tree_ffd), ("bfd", bisect_bfd)])
def test_decreasing_planners_equal_oracle_with_thousands_of_rows(strategy, oracle):
  rng = np.random.default_rng(21)
  for seq_len, n in ((64, 20000), (1000, 8000)):
    lengths = np.round(rng.lognormal(np.log(seq_len / 5), 1.2, n)).astype(np.int64)
    chunks = naive_chunks(lengths.tolist(), seq_len, extra_tokens=1, overlap=3)
    expected = [[chunks[i] for i in b] for b in oracle([c[2] for c in chunks], seq_len)]
    got = packing.plan(lengths, seq_len, strategy=strategy, extra_tokens=1, overlap=3)
    assert got.num_rows == len(expected) > 1000
    assert plan_rows(got) == expected


def test_stable_argsort_matches_numpy_on_wide_keys():
  from segpack.packing.sorting import stable_argsort
  rng = np.random.default_rng(2)
  for high in (10, 70000, 5_000_000_000):
    keys = rng.integers(0, high, 50000)
    np.testing.assert_array_equal(stable_argsort(keys), np.argsort(keys, kind="stable"))
  np.testing.assert_array_equal(stable_argsort(np.arange(100000)), np.arange(100000))


# ---------------------------------------------------------------------------------------------
# The statistics CLI and the benchmark's plumbing


def _write_shards(path, lengths):
  from segpack.shards import ShardWriter
  rng = np.random.default_rng(0)
  with ShardWriter(path, vocab_size=100, tokenizer_fingerprint="test-tok", shard_tokens=500) as w:
    for n in lengths:
      w.write(rng.integers(3, 100, int(n)))


def test_pack_cli_reports_one_plan(tmp_path, capsys):
  import json
  from segpack.cli import stats as pack
  lengths = np.random.default_rng(1).integers(1, 150, 300)
  _write_shards(tmp_path / "data", lengths)
  assert pack.main(["--data", str(tmp_path / "data"), "--seq-len", "64", "--json",
                    "--save-plan"]) == 0
  row = json.loads(capsys.readouterr().out)
  tokens = int((lengths + 2).sum())  # BOS and EOS are on by default
  assert row["tokens"] == tokens and row["lower_bound"] == -(-tokens // 64)
  expected = packing.plan(lengths, 64, extra_tokens=2)
  assert row["rows"] == expected.num_rows
  assert row["split"] == int(np.sum(lengths + 2 > 64))
  assert row["segments_per_row_max"] == int(np.diff(expected.row_splits).max())
  assert len(os.listdir(tmp_path / "data" / "plans")) == 1
  assert pack.main(["--data", str(tmp_path / "data"), "--seq-len", "64", "--no-add-bos",
                    "--no-add-eos", "--strategy", "greedy"]) == 0
  text = capsys.readouterr().out
  assert "strategy greedy" in text and f"{int(lengths.sum()):,}" in text


def test_pack_cli_compare_table(tmp_path, capsys):
  import json
  from segpack.cli import stats as pack
  lengths = np.random.default_rng(2).integers(1, 300, 500)
  np.save(tmp_path / "lengths.npy", lengths)
  assert pack.main(["--data", str(tmp_path / "lengths.npy"), "--compare", "--seq-lens",
                    "64,256", "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)
  assert {(r["strategy"], r["seq_len"]) for r in rows} == {
      (s, n) for s in packing.STRATEGIES for n in (64, 256)}
  util = {(r["strategy"], r["seq_len"]): r["utilization"] for r in rows}
  assert util["ffd", 256] > util["greedy", 256] > util["pad", 256]
  assert pack.main(["--data", str(tmp_path / "lengths.npy"), "--compare", "--seq-lens",
                    "64,256"]) == 0
  assert "utilization" in capsys.readouterr().out


def test_pack_cli_errors_name_the_flag(tmp_path, capsys):
  from segpack.cli import stats as pack
  assert pack.main(["--data", str(tmp_path / "nope")]) == 2
  assert "--data" in capsys.readouterr().err
  np.save(tmp_path / "l.npy", np.array([1, 2]))
  assert pack.main(["--data", str(tmp_path / "l.npy"), "--strategy", "bestest"]) == 2
  assert "'bestest'" in capsys.readouterr().err


def test_bench_runs_on_tiny_sizes(tmp_path, capsys):
  import json
  from segpack.bench import packing as bench
  assert bench.main(["--num-docs", "2000", "--seq-len", "512", "--mean", "100", "--repeats", "1",
                     "--grain-docs", "50",
                     "--load-docs", "300", "--load-batches", "3", "--builtin", "none",
                     "--work-dir", str(tmp_path), "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  sections = [r["section"] for r in out["results"]]
  assert sections == ["plan", "plan", "grain", "grain", "load"]
  plan_rows_ = [r for r in out["results"] if r["section"] == "plan"]
  assert all(r["rows"] >= r["lower_bound"] for r in plan_rows_)
  load = out["results"][-1]
  assert load["features"] == ["input_ids", "labels", "segment_ids", "segment_positions"]


def test_unwritable_cache_returns_the_plan_uncached(tmp_path, monkeypatch, caplog):
  def refuse(self, path, **kwargs):
    raise PermissionError(f"read-only: {path}")

  monkeypatch.setattr(packing.Plan, "save", refuse)
  p = packing.load_or_plan(np.arange(1, 20), 16, cache_dir=tmp_path / "ro", key="k")
  assert p.num_pieces == 19 + 3  # 17, 18 and 19 are split in two
  assert "cannot write the plan cache" in caplog.text


def test_plan_docstring_example_and_save_without_overwrite(tmp_path):
  p = packing.plan(np.array([5, 3, 6]), 8)
  assert p.row_splits.tolist() == [0, 1, 3] and p.doc.tolist() == [2, 0, 1]
  assert p.length.tolist() == [6, 5, 3] and p.start.tolist() == [0, 0, 0]
  assert p.save(tmp_path / "plan", overwrite=False)
  other = packing.plan(np.array([1, 2]), 8)
  assert not other.save(tmp_path / "plan", overwrite=False)  # the first plan stays
  assert packing.Plan.load(tmp_path / "plan").doc.tolist() == [2, 0, 1]
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]

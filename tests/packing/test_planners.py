"""Tests of segpack.packing.plan (planner.py and the ffd, bfd, greedy, pad, sorted_pad
strategies): exactness against naive textbook planners, plan invariants and statistics, errors;
and the plumbing of the statistics CLI and the packing benchmark."""

import os
import pickle

import numpy as np
import pytest

from support.packing_oracles import (NAIVE, bisect_bfd, naive_bfd, naive_chunks, naive_ffd, plan_rows,
                             random_lengths, tree_ffd)
from segpack import packing
from segpack.packing import chunking, layout


def library(kw):
  """The oracle's chunking keywords (`long_docs` a mode, `min_len`, `overlap`) as `plan` takes
  them: one `LongDocs`."""
  kw = dict(kw)
  long_docs = packing.LongDocs(mode=kw.pop("long_docs", "split"), overlap=kw.pop("overlap", 0),
                               min_len=kw.pop("min_len", 0))
  return dict(kw, long_docs=long_docs)


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
    got = packing.plan(lengths, seq_len, strategy=strategy, extra_tokens=extra,
                       long_docs=packing.LongDocs(mode=long_docs, overlap=overlap, min_len=min_len))
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
    long_docs = str(rng.choice(packing.LONG_DOC_MODES))
    if not np.any(lengths + extra > 0):
      continue
    p = packing.plan(lengths, seq_len, strategy=strategy, extra_tokens=extra,
                     long_docs=packing.LongDocs(mode=long_docs, overlap=overlap))
    check_plan_invariants(p, lengths, extra_tokens=extra, overlap=overlap,
                          long_docs=long_docs, min_len=0)
    assert p.stats["tokens"] == int(p.length.sum())
    assert p.stats["rows"] == p.num_rows


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
    (dict(lengths=[3, 4], seq_len=8, long_docs=packing.LongDocs(overlap=8)), "overlap=8"),
    (dict(lengths=[3, 4], seq_len=8, long_docs=packing.LongDocs(overlap=-1)), "overlap=-1"),
    (dict(lengths=[3, 4], seq_len=8, long_docs=packing.LongDocs(mode="drop")), "'drop'"),
    (dict(lengths=[3, 4], seq_len=8, long_docs="split"), "long_docs='split'"),
    (dict(lengths=[3, 4], seq_len=0), "seq_len=0"),
    (dict(lengths=[3, 4], seq_len=8, long_docs=packing.LongDocs(min_len=-2)), "min_len=-2"),
    (dict(lengths=[1.5, 2.0], seq_len=8), "float64"),
    (dict(lengths=[[1, 2]], seq_len=8), "1-D"),
    (dict(lengths=[1, 2], seq_len=8, long_docs=packing.LongDocs(min_len=5)), "min_len=5"),
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
# Larger inputs against per-item oracles that are fast enough for thousands of bins


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
    got = packing.plan(lengths, seq_len, strategy=strategy, extra_tokens=1,
                       long_docs=packing.LongDocs(overlap=3))
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
                     "--balance-docs", "3000", "--balance-seq-len", "2048", "--balance-batch", "8",
                     "--balance-ranks", "4", "--repack-docs", "3000", "--scale-docs", "5000",
                     "--work-dir", str(tmp_path), "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  sections = [r["section"] for r in out["results"]]
  assert sections == ["plan", "plan", "grain", "grain", "load", "balance", "repack", "repack",
                      "repack", "scale"]
  fixed, repacked, tied = out["results"][-4:-1]
  assert fixed["rows"] == repacked["rows"] == tied["rows"] and fixed["pairs_again"] == 1.0
  assert 0.0 <= repacked["pairs_again"] < 1.0 and 0.0 <= tied["pairs_again"] < 1.0
  assert repacked["same_rows_as_fixed"] and tied["same_rows_as_fixed"]
  scale = out["results"][-1]
  assert scale["documents"] == 5000 and scale["load_memory_mapped"]
  assert scale["peak_rss"] >= scale["input_rss"] > scale["input_bytes"] == 4 * 5000
  assert scale["rows"] >= scale["lower_bound"]
  balance = out["results"][-5]
  assert 1.0 <= balance["balanced_max_over_mean"] <= balance["random_max_over_mean"]
  plan_rows_ = [r for r in out["results"] if r["section"] == "plan"]
  assert all(r["rows"] >= r["lower_bound"] for r in plan_rows_)
  load = out["results"][-6]
  assert load["features"] == ["input_ids", "labels", "segment_ids", "segment_positions"]


# ---------------------------------------------------------------------------------------------
# The compact-memory path, block by block


@pytest.mark.parametrize("strategy", ["ffd", "bfd"])
def test_blockwise_planning_equals_naive_oracle(strategy, monkeypatch):
  # Blocks of 7 chunks: every blockwise pass (chunking, counting sort, replay of long runs) spans
  # many blocks, with split documents, overlaps, dropped and empty documents.
  monkeypatch.setattr(chunking, "BLOCK", 7)
  monkeypatch.setattr(layout, "BLOCK", 7)
  rng = np.random.default_rng(77)
  for trial in range(12):
    seq_len = int(rng.choice([16, 33, 64]))
    lengths = random_lengths(rng, int(rng.integers(300, 700)), seq_len)
    kw = dict(extra_tokens=int(rng.integers(0, 3)), min_len=int(rng.integers(0, 3)),
              overlap=int(rng.integers(0, seq_len)) if trial % 2 else 0)
    chunks = naive_chunks(lengths.tolist(), seq_len, **kw)
    expected = [[chunks[i] for i in b] for b in NAIVE[strategy]([c[2] for c in chunks], seq_len)]
    got = packing.plan(lengths.astype(np.int32), seq_len, strategy=strategy, **library(kw))
    assert plan_rows(got) == expected, (trial, seq_len)


@pytest.mark.parametrize("block", [7, 1 << 17])
def test_tie_seed_with_split_documents_keeps_every_row_length(block, monkeypatch):
  monkeypatch.setattr(chunking, "BLOCK", block)
  monkeypatch.setattr(layout, "BLOCK", block)
  rng = np.random.default_rng(5)
  for trial in range(6):
    seq_len = int(rng.choice([16, 64]))
    lengths = rng.integers(0, 3 * seq_len, 600)
    kw = dict(extra_tokens=2, min_len=trial % 2, overlap=3 * (trial % 3))
    chunks = naive_chunks(lengths.tolist(), seq_len, **kw)
    for strategy in ("ffd", "bfd"):
      fixed = packing.plan(lengths, seq_len, strategy=strategy, **library(kw))
      tied = packing.plan(lengths, seq_len, strategy=strategy, tie_seed=(trial, 1), **library(kw))
      np.testing.assert_array_equal(tied.row_splits, fixed.row_splits)
      np.testing.assert_array_equal(tied.length, fixed.length)
      pieces = list(zip(tied.doc.tolist(), tied.start.tolist(), tied.length.tolist()))
      assert sorted(pieces) == sorted(chunks)  # every chunk once, with its own start and length
      assert (tied.doc != fixed.doc).any()


def test_repack_planner_equals_plan_with_the_epochs_tie_seed():
  rng = np.random.default_rng(8)
  lengths = np.concatenate([rng.integers(0, 200, 900), [0, 500, 3]])
  for strategy in ("ffd", "bfd", "sorted_pad"):
    kw = library(dict(strategy=strategy, overlap=5, extra_tokens=2, min_len=1))
    planner = packing.RepackPlanner(lengths, 64, seed=3, **kw)
    for epoch in (1, 2, 1):
      want = packing.plan(lengths, 64, tie_seed=(3, epoch), **kw)
      got = planner.plan(epoch)
      assert plan_rows(got) == plan_rows(want), (strategy, epoch)
      assert got.stats == want.stats
    back = pickle.loads(pickle.dumps(planner))  # without its cached rows; recomputes them
    assert plan_rows(back.plan(2)) == plan_rows(planner.plan(2))
  with pytest.raises(packing.PackingArgumentError, match="tie_seed"):
    packing.RepackPlanner(lengths, 64, seed=0, strategy="greedy")
  with pytest.raises(packing.PackingArgumentError, match="seed=-1"):
    packing.RepackPlanner(lengths, 64, seed=-1)


def test_sorted_documents_released_page_by_page_give_the_same_plan(monkeypatch):
  # Every buffer in its own memory map, its pages handed back after each run: a page read after
  # its release would read zeros (document 0) and break the equality with the textbook planner.
  monkeypatch.setattr(layout, "RELEASE_MIN_BYTES", 0)
  monkeypatch.setattr(layout, "RELEASE_STEP_BYTES", 1)
  rng = np.random.default_rng(12)
  lengths = rng.integers(1, 40, 20_000)  # 80 kB of sorted documents, about 20 pages
  chunks = naive_chunks(lengths.tolist(), 64, extra_tokens=2)
  for strategy, oracle in (("ffd", tree_ffd), ("bfd", bisect_bfd)):
    expected = [[chunks[i] for i in b] for b in oracle([c[2] for c in chunks], 64)]
    assert plan_rows(packing.plan(lengths, 64, strategy=strategy, extra_tokens=2)) == expected

"""python -m segpack.bench.attention: tile accounting against brute force, and the CLI records."""

import json

import numpy as np

from segpack.bench import attention as bench


def _brute_tiles(seg_row, block):
  """Causal tiles holding at least one (query, key) pair of the same document."""
  s = len(seg_row)
  mask = (seg_row[:, None] == seg_row[None, :]) & (seg_row[:, None] != 0)
  mask &= np.tril(np.ones((s, s), bool))
  return int(mask.reshape(s // block, block, s // block, block).any(axis=(1, 3)).sum())


def test_ideal_tiles_of_a_block_aligned_document():
  for length in (1, 64, 65, 200, 512):
    seg = np.zeros(1024, np.int32)
    seg[:length] = 1
    assert bench.ideal_tiles(length, 64, 64) == _brute_tiles(seg, 64)


def test_tile_counts_bracket_the_needed_tiles():
  seg, _ = bench.packed_rows(1024, num_rows=6, mean=300, sigma=1.0, seed=3)
  counts = bench.tile_counts(seg, block_q=64, block_k=64)
  needed = sum(_brute_tiles(r, 64) for r in seg)
  # Contiguous segments, causal: a query block's needed key blocks run without a gap from the
  # start of its first segment to its diagonal, so the kernel visits exactly the needed tiles.
  assert counts["tiles_computed"] == needed < counts["tiles_dense"]
  assert counts["tiles_dense"] == 6 * 16 * 17 // 2
  assert 0 < counts["tiles_masked"] <= counts["tiles_computed"]


def test_packed_rows_are_full_contiguous_packings():
  seg, source = bench.packed_rows(2048, num_rows=4, mean=800, sigma=1.0, seed=0)
  assert seg.shape == (4, 2048) and source
  for row in seg:
    ids = row[row != 0]
    assert np.all(np.diff(ids) >= 0) and ids[0] == 1  # 1..k in order, padding only at the end
    assert np.all(row[len(ids):] == 0)


def test_cli_json_records(capsys):
  assert bench.main(["--seq-lens", "2048", "--head-dims", "64", "128", "--rows", "4",
                     "--json"]) == 0
  records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [(r["seq_len"], r["head_dim"]) for r in records] == [(2048, 64), (2048, 128)]
  for r in records:
    for key in ("seq_len", "head_dim", "block_q", "block_k", "tiles_computed", "tiles_dense",
                "tiles_ideal"):
      assert isinstance(r[key], int), key
    assert r["timings"] == "not measured"


def test_cli_table_and_plot(tmp_path, capsys):
  out = tmp_path / "att.png"
  assert bench.main(["--seq-lens", "2048", "--head-dims", "64", "--rows", "4", "--plot",
                     str(out)]) == 0
  text = capsys.readouterr().out
  assert "comp/ideal" in text and "not measured" in text
  assert out.stat().st_size > 1000
  assert [p.name for p in tmp_path.iterdir()] == ["att.png"]  # written atomically, no leftovers


def test_timed_rows_are_a_sample_of_the_plan_not_its_longest_rows():
  # The GPU timing takes the first `tokens // S` rows (4 at S = 8192). FFD's first rows hold
  # the longest documents, one a row; taking the first rows in plan order timed only those.
  lengths = bench.lognormal_lengths(8 * 32 * 8192 // 800, mean=800, sigma=1.5, seed=0)
  plan = bench.packing.plan(lengths, 8192, strategy="ffd")
  docs_per_row = np.diff(np.asarray(plan.row_splits))
  assert np.all(docs_per_row[:8] == 1)  # negative control: a plan-order prefix is one-document rows
  seg, _ = bench.packed_rows(8192, num_rows=32, mean=800, sigma=1.5, seed=0)
  first = [len(bench._segment_lengths(r)) for r in seg[:4]]
  every = [len(bench._segment_lengths(r)) for r in seg]
  assert max(first) > 1
  assert sorted(every) != every  # rows in drawn order, not the plan's

"""`python -m train.bench.memory --quick`: every case measured in its own process or skipped with
the reason, every column printed, and the estimate within 25% of the measured peak.

The peak compared is what the estimate models, the memory of the step's arrays: the peak RSS of
the step's first call above the RSS before it, plus the arrays alive before it (state, batch).
The whole process's peak above its RSS after the imports (`rss`) also holds the runtime's own
memory (compiled code, what compiling left behind: ~0.15 GiB here, a third of the blocked
loss's 0.5 GiB at 1,024 slots), which the estimate does not count; it is checked only to lie
above the step's.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from support import paths
from support import train_configs

from train import memory
from train.bench import memory as bench

COLUMNS = ("vocab", "slots", "loss", "remat", "estimate", "measured", "est/meas", "rss", "xla",
           "step s", "note")
FIELDS = ("vocab", "slots", "loss", "remat", "estimate", "estimate_parts", "measured", "ratio",
          "rss", "xla", "step_s", "note")


@pytest.fixture(scope="module")
def quick():
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "train.bench.memory", "--quick", "--json"],
                        cwd=str(paths.REPO), capture_output=True, text=True, check=False,
                        env=dict(os.environ, XLA_FLAGS=train_configs.one_cpu_device()))
  seconds = time.perf_counter() - start
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines()], seconds


@pytest.mark.slow
def test_the_quick_benchmark_measures_every_case(quick):
  records, _ = quick
  assert [(r["vocab"], r["slots"], r["loss"], r["remat"]) for r in records] == [
      (c.vocab, c.slots, c.loss, c.remat) for c in bench.QUICK_CASES]
  for r in records:
    assert all(key in r for key in FIELDS), sorted(set(FIELDS) - set(r))
  measured = [r for r in records if r["measured"] is not None]
  assert {r["loss"] for r in measured} == {"full", "blocked"}
  for r in measured:
    assert 0.75 <= r["ratio"] <= 1.25, r
    assert r["ratio"] == pytest.approx(r["estimate"] / r["measured"])
    assert r["rss"] > r["measured"] - r["live_bytes"] > 0 and r["step_s"] > 0
    assert r["estimate"] == sum(r["estimate_parts"].values())
    assert r["device"] == "cpu" and r["num_devices"] == 1
  # The blocked loss needs a fraction of the full logits' memory at the same row.
  full, blocked = (next(r for r in measured if r["loss"] == loss and r["remat"] == "none")
                   for loss in ("full", "blocked"))
  assert blocked["measured"] < 0.5 * full["measured"]
  assert blocked["loss_value"] == pytest.approx(full["loss_value"], rel=1e-5)


@pytest.mark.slow
def test_a_case_too_large_is_skipped_with_the_reason_and_the_table_has_every_column(quick):
  records, _ = quick
  skipped = [r for r in records if r["note"].startswith("skipped")]
  assert len(skipped) == 1 and skipped[0]["measured"] is None
  note = skipped[0]["note"]
  assert "one training step needs about" in note and "loss.block_size" in note
  table = bench.format_table(records).splitlines()
  assert table[0].split() == [w for c in COLUMNS for w in c.split()]
  assert len(table) == 2 + len(records)
  assert all(row.split()[4] != "-" for row in table[2:])  # every case has its estimate
  assert "not yet wired" not in "\n".join(table)


def test_the_cases_estimate_what_their_configs_build():
  case = bench.Case(vocab=1_000, slots=256, loss="blocked", remat="full")
  config = bench.case_config(case)
  assert (config.loss.block_size, config.loss.vocab_block_size) == (bench.BLOCK,
                                                                  bench.VOCAB_BLOCK)
  assert config.model.remat == "full" and config.packing.seq_len == 256
  est = bench.case_estimate(case)
  weights = 2 * 1_000 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64  # untied head
  assert est.parameters == 4 * weights and est.blocked
  assert est.logits == 256 * 1_000 * 4  # one block of the whole row, all of V
  assert est.activations == memory.estimate(
      num_params=weights, vocab_size=1_000, d_model=64, d_ff=128, num_layers=2, num_heads=1,
      num_kv_heads=1, head_dim=64, batch_rows=1, seq_len=256, loss_block=bench.BLOCK,
      remat="none").activations  # the CPU applies no remat


def test_a_row_is_packed_documents_with_their_labels():
  row = bench._row(1_100, 50)  # pylint: disable=protected-access
  assert row["segment_ids"][0, [0, 511, 512, 1_099]].tolist() == [1, 1, 2, 3]
  assert row["segment_positions"][0, [0, 511, 512, 1_099]].tolist() == [0, 511, 0, 75]
  ends = (row["labels"] == -100).nonzero()[1].tolist()
  assert ends == [511, 1_023, 1_099]
  assert (row["labels"][0, :511] == row["input_ids"][0, 1:512]).all()

"""`python -m train.bench rl` at a tiny size: the three layouts train the same completion tokens
(the same work), the prompt stored once takes fewer slots than copied, and the table and JSON
carry every figure (no timing is asserted: numbers live in the benchmark)."""

import json

from train.bench import rl as rl_bench
from train.bench import training


def test_the_layouts_train_the_same_tokens_and_shared_takes_fewer_slots(capsys):
  r = rl_bench.bench(prompts=3, generations=4, prompt=40, completion=8, max_completion=30,
                     seq_len=256, batch_size=1, padded_rows=4, d_model=64, seed=0, sample=False)
  assert r["padded_trained_tokens"] == r["copied_trained_tokens"] == r["shared_trained_tokens"]
  assert r["shared_slots"] <= r["copied_slots"]
  real = {k: r[f"{k}_utilization"] * r[f"{k}_slots"] for k in rl_bench.LAYOUTS}
  assert real["shared"] < real["copied"] == real["padded"]  # the prompt copies are the gap
  assert r["sample_s"] is None and r["shared_vs_copied"] > 0
  table = rl_bench.table(r)
  for line in ("padded", "copied", "shared", "shared vs copied", "sampling"):
    assert line in table
  assert "sampling not measured" in table
  assert training.main(["rl", "--prompts", "2", "--generations", "2", "--prompt", "16",
                        "--completion", "4", "--max-completion", "8", "--seq-len", "128",
                        "--d-model", "64", "--json"]) == 0  # the sampling time too
  out = json.loads(capsys.readouterr().out)
  assert out["sample_s"] > 0 and out["prompts"] == 2

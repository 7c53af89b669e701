"""`python -m train.bench preference` on a few tiny pairs: the three layouts train on the same
pairs, each exactly once, and the table and JSON say so (the benchmark asserts no time)."""

import json

from train.bench import preference as preference_bench
from train.bench import training as training_bench


def test_the_three_layouts_train_every_pair_once_and_report_side_by_side(capsys):
  argv = ["preference", "--pairs", "12", "--prompt", "24", "--answer", "8", "--seq-len", "128",
          "--d-model", "64", "--pad-multiple", "128", "--json"]  # one padded shape: one compile
  assert training_bench.main(argv) == 0
  result = json.loads(capsys.readouterr().out)
  for layout in preference_bench.LAYOUTS:
    assert result[f"{layout}_pairs"] == 12, layout
    assert result[f"{layout}_pairs_per_s"] > 0
  # Packing fills rows the padded layout leaves empty; shared prompts take fewer slots still.
  assert result["packed_utilization"] > result["padded_utilization"]
  assert result["shared_slots"] <= result["packed_slots"]
  assert result["shared_real_tokens"] < result["packed_real_tokens"]
  assert result["packed_speedup"] == result["packed_pairs_per_s"] / result["padded_pairs_per_s"]
  table = preference_bench.table(result)
  assert all(name in table for name in preference_bench.LAYOUTS) and "vs padded" in table

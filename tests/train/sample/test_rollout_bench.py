"""`train.sample.rollout_bench`, the rollout sections of `python -m train.sample --benchmark`,
at a quarter size on tiny models: what each section must show whatever the machine's speed
(one prefill's prompt cache is 1/n of the copies'; static batches use fewer lane-steps than
lanes reused; top-p's drawn log-probs are above the full ones by the log of the kept mass, and
equal at top_p 1), and the transformers section on a model transformers wrote."""

import numpy as np
import pytest

from support.train_configs import synthetic_config
from train.model import decoder as model_lib
from train.sample import bench as sample_bench
from train.sample import rollout_bench


@pytest.fixture(scope="module")
def model():
  return model_lib.build(synthetic_config(**{"attention.implementation": "xla"}), 0,
                         vocab_size=97)


def test_the_sections_show_the_shared_prefill_the_lane_reuse_and_the_truncation_gap(model):
  out = dict(shared=rollout_bench.shared(model, prompts=2, n=4, new_tokens=4, repeats=1),
             lengths=rollout_bench.lengths(model, completions=24, lanes=4, mean=4, repeats=1),
             truncation=rollout_bench.truncation(model, prompts=2, new_tokens=4),
             transformers=rollout_bench.versus_transformers(
                 model, model_dir=None, prompts=1, n=2, new_tokens=2, repeats=1))
  one, copies = out["shared"]
  assert one["completions"] == copies["completions"] == 8
  assert one["prompt_cache_mb"] * 4 == copies["prompt_cache_mb"]  # 2 prompts held vs 8 copies
  equal, reused, static = out["lengths"]
  assert reused["tokens"] == static["tokens"] and reused["longest"] == equal["longest"] == 16
  assert static["lane_use"] < 0.8 * reused["lane_use"] and 0 < reused["lane_use"] <= 1
  by_p = {r["top_p"]: r for r in out["truncation"]}
  assert by_p[1.0]["median_abs_delta_logp"] == pytest.approx(0, abs=1e-6)
  assert by_p[1.0]["share_outside_0_9_1_1"] == 0
  assert 0 < by_p[0.95]["median_abs_delta_logp"] <= by_p[0.8]["median_abs_delta_logp"]
  assert by_p[0.8]["mean_ratio"] < 1
  engine_row, hf_row = out["transformers"]
  assert engine_row["tokens_per_s"] > 0 and hf_row["tokens_per_s"] is None
  assert "not measured" in hf_row["note"]
  table = "\n".join(rollout_bench.section_table(k, v) for k, v in out.items())
  assert "[lengths]" in table and "not measured" in table


def test_the_transformers_section_times_both_on_one_imported_model(tmp_path):
  pytest.importorskip("transformers")
  pytest.importorskip("torch")
  model_dir = rollout_bench.hf_model(str(tmp_path / "llama"), vocab=97, layers=1, width=64)
  imported = sample_bench._imported(model_dir)
  assert imported.cfg.num_layers == 1 and imported.cfg.vocab_size == 97
  engine_row, hf_row = rollout_bench.versus_transformers(imported, model_dir=model_dir, prompts=1,
                                                         n=2, new_tokens=4, repeats=1)
  assert hf_row["tokens_per_s"] > 0
  np.testing.assert_allclose(engine_row["vs_transformers"],
                             engine_row["tokens_per_s"] / hf_row["tokens_per_s"])

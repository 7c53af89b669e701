"""`python -m train.bench.adapters --quick`: the issue's bounds on LoRA's optimizer state and
QLoRA's base, XLA's peaks in the order full > LoRA > QLoRA, the counts against the shapes worked
out by hand, and QLoRA's logits near the bfloat16 base's where a broken base is not.

The quality tolerances are set from the measured quick figures with a margin of about ten:
on the smoke model trained 60 steps the nf4 base's label log-probs differ from the bfloat16
base's by 0.0053 on average and the int8 base's by 0.00036, while the nf4 base with its scales
doubled (the negative control) differs by 0.16.

The two sections are one test each (slow: five compiles of the step, one training run and five
forward passes; about 25 s of CPU each), so that under `-n 2` each runs once, on its own worker.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from train.model import quantize
from train.bench import adapters as bench

NF4_TOLERANCE = 0.05  # mean |log p(label) - log p_bf16(label)|, nats
INT8_TOLERANCE = 0.005


def _shapes():
  """The `[I, O]` of the seven projections of one layer of the benchmark's model."""
  m = bench.MODEL
  e, f = m["d_model"], m["d_ff"]
  q, kv = m["num_heads"] * m["head_dim"], m["num_kv_heads"] * m["head_dim"]
  return dict(q=(e, q), k=(e, kv), v=(e, kv), o=(q, e), gate=(e, f), up=(e, f), down=(f, e))


def _check_counts(memory):
  """Parameters and bytes of every case against the shapes worked out by hand."""
  layers, shapes, m = bench.QUICK_LAYERS, _shapes(), bench.MODEL
  projections = layers * sum(i * o for i, o in shapes.values())
  everything = projections + 2 * m["vocab_size"] * m["d_model"] + (2 * layers + 1) * m["d_model"]
  adapters = layers * sum(bench.RANK * (i + o) for i, o in shapes.values())
  nf4 = layers * sum(i * o // 2 + i // quantize.BLOCK * o * 4 for i, o in shapes.values())
  assert memory["full float32"]["trained_params"] == everything
  assert memory["full bfloat16"]["trained_bytes"] == 2 * everything
  for name in ("LoRA bfloat16", "QLoRA nf4", "QLoRA int8"):
    r = memory[name]
    assert (r["trained_params"], r["frozen_params"]) == (adapters, everything), name
    assert r["trained_bytes"] == 4 * adapters  # float32 adapters
    assert r["optimizer_bytes"] == 2 * r["trained_bytes"] + 8  # Adam's moments; two int32 counts
  assert memory["LoRA bfloat16"]["projection_base_bytes"] == 2 * projections
  assert memory["QLoRA nf4"]["projection_base_bytes"] == nf4
  assert memory["QLoRA nf4"]["base_bytes"] == nf4 + 2 * (everything - projections)


@pytest.mark.slow
def test_quick_memory_meets_the_issue_bounds_and_peaks_order_full_lora_qlora():
  """One test for the whole section: its five compiles run once (under `-n 2` a module fixture
  shared by several tests would run in both workers)."""
  records = [bench.memory_case(case, quick=True) for case in bench.CASES]
  records.append(bench.ratios(records))
  memory = {r["case"]: r for r in records if r["section"] == "memory"}
  assert list(memory) == [c.name for c in bench.CASES]
  _check_counts(memory)
  ratios = records[-1]
  assert ratios["lora_optimizer_vs_full_float32"] <= 0.02
  assert ratios["lora_optimizer_vs_full_bfloat16"] <= 0.02  # 2 layers: the embeddings weigh more
  assert ratios["nf4_base_vs_bfloat16_projections"] <= 0.30
  assert ratios["nf4_base_vs_bfloat16_projections"] == pytest.approx((0.5 + 4 / 64) / 2)
  assert ratios["int8_base_vs_bfloat16_projections"] == pytest.approx((1 + 4 / 64) / 2)
  peak = {name: r["xla_peak"] for name, r in memory.items()}
  assert all(isinstance(v, int) and v > 0 for v in peak.values()), peak
  assert (peak["full float32"] > peak["full bfloat16"] > peak["LoRA bfloat16"]
          > peak["QLoRA int8"] > peak["QLoRA nf4"]), peak
  # The adapter cases differ only by their stored base: the same temporaries.
  assert len({memory[n]["xla_temp"] for n in ("LoRA bfloat16", "QLoRA nf4", "QLoRA int8")}) == 1
  assert peak["LoRA bfloat16"] - peak["QLoRA nf4"] == (memory["LoRA bfloat16"]["base_bytes"]
                                                       - memory["QLoRA nf4"]["base_bytes"])
  table = bench.format_table(records)
  assert all(name in table for name in memory) and "projections alone" in table


@pytest.mark.slow
def test_qlora_logits_stay_near_the_bfloat16_base_and_a_broken_base_does_not():
  records = bench.quality(bench.QUICK_STEPS, eval_batches=bench.QUICK_EVAL_BATCHES)
  by = {r["base"]: r for r in records}
  assert list(by) == [name for name, _, _ in bench.BASES]
  assert by["bfloat16"]["mean_abs_logprob_diff"] == 0.0  # the reference against itself
  assert by["nf4"]["eval_tokens"] > 1000
  assert 0 < by["nf4"]["mean_abs_logprob_diff"] < NF4_TOLERANCE
  assert 0 < by["int8"]["mean_abs_logprob_diff"] < INT8_TOLERANCE
  assert by["int8"]["mean_abs_logprob_diff"] < by["nf4"]["mean_abs_logprob_diff"]
  assert by["nf4"]["mean_abs_logit_diff"] < NF4_TOLERANCE
  control = by["nf4, scales x2 (control)"]
  assert control["mean_abs_logprob_diff"] > NF4_TOLERANCE
  assert control["mean_abs_logit_diff"] > NF4_TOLERANCE
  assert all(np.isfinite(r["eval_loss"]) for r in by.values())
  # trained: the held-out loss is below a uniform guess over the 2,048 tokens
  assert by["bfloat16"]["eval_loss"] < np.log(2048) - 1
  table = bench.format_table(records)
  assert all(name in table for name in by)


def test_a_filled_nf4_base_dequantizes_to_the_float_kernel_within_its_blocks():
  rng = np.random.default_rng(0)
  w_IxO = rng.normal(0, 0.02, size=(128, 32)).astype(np.float32)
  frozen = {"layers": {"0": {"mlp": {"up": {
      "kernel": np.zeros((64, 32), np.uint8), "kernel_scale": np.zeros((2, 32), np.float32)}},
      "mlp_norm": {"scale": np.zeros((128,), jnp.bfloat16)}}}}
  floats = {"layers/0/mlp/up/kernel": w_IxO, "layers/0/mlp_norm/scale": np.ones(128, np.float32)}
  filled = bench.fill_base(frozen, floats, kind="nf4")
  up = filled["layers"]["0"]["mlp"]["up"]
  back_IxO = np.asarray(quantize.dequantize(kind="nf4", codes=up["kernel"],
                                            scales=up["kernel_scale"], dtype=jnp.float32))
  absmax_BxO = np.abs(w_IxO.reshape(2, 64, 32)).max(axis=1)
  gap = (quantize.NF4_CODE[1:] - quantize.NF4_CODE[:-1]).max() / 2  # the widest half-gap
  assert np.all(np.abs(back_IxO - w_IxO).reshape(2, 64, 32) <= gap * absmax_BxO[:, None] + 1e-7)
  assert filled["layers"]["0"]["mlp_norm"]["scale"].dtype == jnp.bfloat16
  doubled = bench.fill_base(frozen, floats, kind="nf4", scale_factor=2.0)
  np.testing.assert_array_equal(doubled["layers"]["0"]["mlp"]["up"]["kernel_scale"],
                                2 * np.asarray(up["kernel_scale"]))

"""Model FLOPs (real tokens, within-document attention), peak FLOP/s and MFU in the train log."""

import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from train.model import flops as flops_lib
from train import metrics as metrics_lib
from train.model import config as model_config
from train.model import decoder as model_lib
from train import steps as steps_lib

# One row: documents of lengths 3 and 5, then 4 padding slots; a second row: all padding.
SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0, 0],
                     [0] * 12], np.int32)


def _model_cfg(**overrides):
  kw = dict(num_layers=1, d_model=8, num_heads=2, num_kv_heads=1, head_dim=4, d_ff=16)
  kw.update(overrides)
  return ml_collections.ConfigDict(kw)


def test_attention_pairs_of_two_documents_and_padding():
  # Causal pairs: 3 * 4 / 2 + 5 * 6 / 2 = 6 + 15; padding adds nothing.
  assert float(flops_lib.attention_pairs(jnp.asarray(SEGMENTS))) == 21.0
  assert float(jax.jit(flops_lib.attention_pairs)(jnp.asarray(SEGMENTS))) == 21.0


def test_attention_pairs_of_padding_between_documents_and_length_one():
  seg = np.array([[0, 0, 4, 0, 7, 7, 9, 9, 9, 9]], np.int32)  # 1 + 3 + 10 pairs
  assert float(flops_lib.attention_pairs(jnp.asarray(seg))) == 14.0
  full = np.ones((2, 4096), np.int32)  # exact for a full 4096 row: 4096 * 4097 / 2 each
  assert float(flops_lib.attention_pairs(jnp.asarray(full))) == 2 * 4096 * 4097 / 2


def test_step_flops_of_the_hand_computed_example():
  """E=8, H=2, K=1, D=4, F=16, V=10, L=1: N = 8*8 + 2*8*4 + 8*8 + 3*8*16 + 8*10 = 656 matmul
  parameters; the example row has 8 real tokens and 21 pairs."""
  model = flops_lib.FlopModel.from_model_config(_model_cfg(), vocab_size=10)
  assert model == flops_lib.FlopModel(matmul_params=656, attention_width=8)
  # 6 * 656 * 8 (dense) + 12 * (L * H * D = 8) * 21 (attention) = 31,488 + 2,016.
  assert model.step_flops(real_tokens=8, attention_pairs=21) == 33_504


@pytest.mark.parametrize("overrides", [{}, dict(num_layers=3, num_kv_heads=2, d_ff=24)])
def test_matmul_params_are_the_models_kernels(overrides):
  cfg = _model_cfg(**overrides)
  decoder = model_config.DecoderConfig(vocab_size=10, **cfg.to_dict())
  params = nnx.split(nnx.eval_shape(lambda: model_lib.Decoder(decoder, rngs=nnx.Rngs(0))))[1]
  kernels = sum(int(np.prod(x.shape)) for path, x in jax.tree_util.tree_leaves_with_path(params)
                if "['kernel']" in jax.tree_util.keystr(path))
  assert flops_lib.FlopModel.from_model_config(cfg, vocab_size=10).matmul_params == kernels


def test_the_train_step_reports_the_attention_pairs_of_its_batch():
  cfg = model_config.DecoderConfig(vocab_size=10, **_model_cfg().to_dict())
  graphdef, params = nnx.split(model_lib.Decoder(cfg, rngs=nnx.Rngs(params=0)))
  train_cfg = ml_collections.ConfigDict(dict(
      learning_rate=1e-3, warmup_steps=1, num_steps=2, min_lr_ratio=0.1, grad_clip=1.0, b1=0.9,
      b2=0.95, eps=1e-8, weight_decay=0.1))
  tx, schedule = steps_lib.make_optimizer(train_cfg)
  seg = jnp.asarray(SEGMENTS)
  batch = dict(input_ids=jnp.ones_like(seg), segment_ids=seg, segment_positions=jnp.zeros_like(seg),
               labels=jnp.where(seg > 0, 1, -100))
  state = dict(params=params, opt_state=tx.init(params), step=jnp.int32(0))
  _, metrics = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=2))(state, batch)
  assert float(metrics["attention_pairs"]) == 21.0 and float(metrics["real_tokens"]) == 8.0


def _device(kind):
  return types.SimpleNamespace(device_kind=kind)


@pytest.mark.parametrize("kind,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 NVL", None),
    ("Tesla V100-SXM2-16GB", None),
    ("cpu", None),
])
def test_peak_flops_from_the_device_kind(kind, peak):
  assert flops_lib.device_peak_flops(kind, compute_dtype="bfloat16") == peak
  got = flops_lib.peak_flops(None, devices=[_device(kind)] * 2, compute_dtype="bfloat16")
  assert got == (None if peak is None else 2 * peak)


def test_peak_flops_override_and_float32():
  h100 = [_device("NVIDIA H100 80GB HBM3")] * 4
  assert flops_lib.peak_flops(None, devices=h100, compute_dtype="float32") is None
  assert flops_lib.peak_flops(5e14, devices=h100, compute_dtype="float32") == 4 * 5e14
  with pytest.raises(ValueError, match=r"train.peak_flops.*-1"):
    flops_lib.peak_flops(-1.0, devices=h100, compute_dtype="bfloat16")


def test_throughput_reports_model_flops_and_mfu_over_the_window(monkeypatch):
  clock = iter([100.0, 102.0, 106.0, 0.0, 1.0])  # start, two reports; then no_peak
  monkeypatch.setattr(metrics_lib, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  model = flops_lib.FlopModel(matmul_params=656, attention_width=8)
  meter = metrics_lib.Throughput(start_step=0, num_steps=4, flop_model=model, peak_flops=1e5)
  meter.add(real_tokens=8, slots=24, attention_pairs=21)
  meter.add(real_tokens=8, slots=24, attention_pairs=21)
  first = meter.report(2)
  assert first["model_flops_per_s"] == 2 * 33_504 / 2.0
  assert first["mfu"] == pytest.approx(33_504 / 1e5)
  meter.add(real_tokens=0, slots=24, attention_pairs=0)  # an all-padding step: no model FLOPs
  assert meter.report(3)["model_flops_per_s"] == 0.0
  record = dict(kind="train", step=2, loss=1.0, lr=1e-3, grad_norm=1.0, **first)
  assert "MFU 33.5%" in metrics_lib._format(record)  # pylint: disable=protected-access
  no_peak = metrics_lib.Throughput(start_step=0, num_steps=1, flop_model=model)
  assert no_peak.report(1)["mfu"] is None
  assert "MFU n/a" in metrics_lib._format(dict(  # pylint: disable=protected-access
      kind="train", step=1, loss=1.0, lr=1e-3, grad_norm=1.0, real_tokens_per_s=1.0,
      slot_utilization=1.0, elapsed_s=1.0, eta_s=0.0, mfu=None))


def test_attention_pairs_of_a_context_ordered_row_equal_the_row_order():
  # Zigzag order over cp=2 cuts documents into pieces; counted pairs must not change.
  seg_1xS = np.array([[1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 0]])
  naive = sum(n * (n + 1) // 2 for n in (5, 2, 4))
  order = np.array([0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8])
  reordered_1xS = seg_1xS[:, order]
  assert float(flops_lib.attention_pairs(jnp.asarray(seg_1xS))) == naive
  assert float(flops_lib.attention_pairs(jnp.asarray(reordered_1xS), reordered=True)) == naive
  # Without `reordered` the pieces would be counted as separate runs.
  assert float(flops_lib.attention_pairs(jnp.asarray(reordered_1xS))) != naive

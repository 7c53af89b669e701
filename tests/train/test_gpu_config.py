"""`configs/packed.py:gpu` proven on the CPU: its size, its step lowered for `cuda` (Pallas through
Triton), its memory against an 80 GB H100, and two training steps at reduced width.

No real arrays of the full model are made (tests/support/config_steps.py).
"""


import jax
import numpy as np
import pytest
from flax import nnx

from configs import packed
from train.model import flops as flops_lib
from train import metrics as metrics_lib
from train.model import decoder as model_lib
from train import sharding as sharding_lib
from train import train as train_lib

from support.config_steps import H100_BYTES
from support.config_steps import VOCAB
from support.config_steps import abstract_step
from support.config_steps import cuda_text_with_triton_kernels
from support.config_steps import extrapolate
from support.config_steps import named_config
from support.config_steps import step_memory_by_layers

# Parameters of the gpu config (configs/packed.py:gpu docstring), and those in matmuls.
PARAMS, MATMUL_PARAMS = 113_271_552, 106_954_752


def _abstract_step(config):
  """The trainer's jitted step on one device and abstract `(state, micro-batched batch)`."""
  mesh = sharding_lib.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
  return abstract_step(config, mesh)


def _count(tree, keep=lambda path: True):
  return sum(int(np.prod(x.shape)) for path, x in jax.tree_util.tree_leaves_with_path(tree)
             if keep(jax.tree_util.keystr(path)))


def test_gpu_config_is_a_113m_bf16_pallas_decoder():
  c = packed.get_config("gpu")
  assert (c.model.dtype, c.model.param_dtype, c.attention.implementation) == (
      "bfloat16", "float32", "pallas")
  assert c.packing.seq_len == 4096 and c.train.warmup_steps < c.train.num_steps
  params = nnx.split(nnx.eval_shape(lambda: model_lib.build(c, 0, vocab_size=VOCAB)))[1]
  assert _count(params) == PARAMS
  assert _count(params, lambda p: "['kernel']" in p) == MATMUL_PARAMS
  assert flops_lib.FlopModel.from_model_config(c.model, vocab_size=VOCAB).matmul_params == \
      MATMUL_PARAMS


def test_gpu_train_step_lowers_for_cuda_with_the_pallas_triton_kernels():
  c = packed.get_config("gpu")
  traced, _ = _abstract_step(c)
  text = cuda_text_with_triton_kernels(traced, num_layers=c.model.num_layers)
  assert "bf16" in text and "tensor<8x4096xi32>" in text  # 16 rows in 2 micro-batches of 8


def analytic_bytes(config, *, vocab: int) -> dict[str, float]:
  """An analytic upper estimate of one step's device memory (no rematerialisation).

  State: parameters, gradients, the gradient accumulator and Adam's two moments, float32. Kept for
  the backward pass, per token of one micro-batch: per layer, in bfloat16 the inputs and outputs
  of both norms (4E), q, k, v (H*D + 2*K*D), rotated q and k (H*D + K*D), the attention output
  (H*D), gate, up, silu(gate) and their product (4F), and in float32 both norms' normalised
  inputs (2E) and the attention's log-sum-exp (H); then bfloat16 and float32 logits, float32
  log-probabilities and their gradient (2V + 3 * 4V).
  """
  m = config.model
  e, f, hd, kd = m.d_model, m.d_ff, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  per_layer = 2 * (4 * e + 3 * hd + 3 * kd + 4 * f) + 4 * (2 * e + m.num_heads)
  per_token = m.num_layers * per_layer + 14 * vocab
  tokens = config.train.batch_size // config.train.grad_accum_steps * config.packing.seq_len
  params = m.num_layers * (e * hd + 2 * e * kd + hd * e + 3 * e * f + 2 * e) + 2 * vocab * e + e
  return dict(state=5 * 4 * params, activations=per_token * tokens)


@pytest.mark.slow
def test_gpu_step_memory_fits_an_80gb_h100():
  """XLA's buffer assignment for the full-size step (CPU compile, Pallas in interpret mode) and the
  analytic estimate both stay well under 80 GB.

  Compiling 16 layers for the CPU takes ~40 s, so 1 and 2 layers are compiled and the memory is
  extrapolated linearly in L (checked once: 1, 2, 4 and 16 layers lie on one line to 0.1%).
  """
  totals = {n: total for n, (_, _, total) in step_memory_by_layers("gpu", _abstract_step).items()}
  c = packed.get_config("gpu")
  xla_bytes = extrapolate(totals[1], totals[2], layers=c.model.num_layers)
  analytic = analytic_bytes(c, vocab=VOCAB)
  assert analytic["state"] == 20 * PARAMS
  print(f"gpu config step memory: XLA (CPU) {xla_bytes / 1e9:.1f} GB, analytic "
        f"{sum(analytic.values()) / 1e9:.1f} GB")
  assert 10e9 < xla_bytes < 0.75 * H100_BYTES
  assert 10e9 < sum(analytic.values()) < 0.75 * H100_BYTES


@pytest.mark.slow
def test_gpu_config_trains_two_steps_at_reduced_width(tmp_path, capsys):
  """The gpu config's trainer path (bf16 compute, 2 micro-batches, startup leak check) at reduced
  width, sequence and data, with XLA attention (the Pallas model path against XLA is
  tests/train/test_model.py's): two finite steps, and the log's model FLOP/s and MFU."""
  c = named_config("gpu", **{
      "data.source": "synthetic", "data.synthetic_docs": 200, "data.synthetic_mean_len": 30,
      "data.synthetic_vocab": 97, "packing.seq_len": 128, "model.num_layers": 2,
      "model.d_model": 64, "model.num_heads": 6, "model.num_kv_heads": 2, "model.head_dim": 16,
      "model.d_ff": 128, "attention.implementation": "xla", "train.num_steps": 2,
      "train.log_every": 1, "train.eval_every": 0, "train.log_batches": False})
  summary = train_lib.train_and_evaluate(c, str(tmp_path))
  train = [r for r in metrics_lib.read(tmp_path) if r["kind"] == "train"]
  assert summary["steps"] == 2 and [r["step"] for r in train] == [1, 2]
  assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in train)
  assert all(r["model_flops_per_s"] > 0 for r in train)
  if jax.default_backend() == "cpu":
    assert all(r["mfu"] is None for r in train)
    assert "MFU n/a" in capsys.readouterr().out

"""`configs/packed.py:gpu` proven on the CPU: its size, its step lowered for `cuda` (Pallas through
Triton), its memory against an 80 GB H100, and two training steps at reduced width.

No real arrays of the full model are made: the state and the batch are `jax.ShapeDtypeStruct`s
(as `train.train._abstract_state` builds them), so lowering and compiling cost seconds.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import packed
from train import flops as flops_lib
from train import metrics as metrics_lib
from train import model as model_lib
from train import sharding as sharding_lib
from train import train as train_lib

VOCAB = 8192  # the full built-in corpus's tokenizer
H100_BYTES = 80e9
# Parameters of the gpu config (configs/packed.py:gpu docstring), and those in matmuls.
PARAMS, MATMUL_PARAMS = 113_271_552, 106_954_752


def _gpu_config(**overrides):
  c = packed.get_config("gpu")
  with c.unlocked():
    for key, value in overrides.items():
      group, name = key.split(".")
      c[group][name] = value
  return c


def _abstract_step(config):
  """The trainer's jitted step on one device and abstract `(state, micro-batched batch)`."""
  mesh = sharding_lib.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
  tx, schedule = train_lib.make_optimizer(config.train)
  abstract_state = train_lib._abstract_state  # pylint: disable=protected-access
  graphdef, abstract = abstract_state(config, VOCAB, tx, mesh)
  step = jax.jit(train_lib.make_train_step(graphdef, tx, schedule,
                                           accum=config.train.grad_accum_steps),
                 donate_argnums=(0,))
  rows = jax.ShapeDtypeStruct((config.train.batch_size, config.packing.seq_len), jnp.int32)
  batch = dict(input_ids=rows, segment_ids=rows, segment_positions=rows, labels=rows)
  return step.trace(abstract, batch), abstract


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
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  assert calls and set(calls) == {"__gpu$xla.gpu.triton"}, set(calls)
  for kernel in ("segment_flash_fwd", "segment_flash_bwd_dq", "segment_flash_bwd_dkv"):
    # Every layer's forward and backward kernels (the micro-batch scan body is lowered once).
    assert len(re.findall(kernel + r"\b", text)) >= c.model.num_layers, kernel
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
  totals = {}
  for layers in (1, 2):
    c = _gpu_config(**{"model.num_layers": layers, "attention.interpret": True})
    traced, abstract = _abstract_step(c)
    mem = traced.lower().compile().memory_analysis()
    # Arguments: float32 parameters and Adam's two moments (plus the batch and the step).
    state_bytes = 3 * 4 * _count(abstract["params"])
    assert state_bytes <= mem.argument_size_in_bytes <= state_bytes + 2**21
    assert mem.alias_size_in_bytes >= state_bytes  # the donated state is updated in place
    totals[layers] = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                      - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
  c = packed.get_config("gpu")
  xla_bytes = totals[1] + (c.model.num_layers - 1) * (totals[2] - totals[1])
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
  tests/test_model.py's): two finite steps, and the log's model FLOP/s and MFU."""
  c = _gpu_config(**{
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

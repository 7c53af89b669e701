"""The full-size trainer configs' steps on abstract shapes (tests/train/test_gpu_config.py,
tests/train/test_long_config.py): no real arrays of the model are made, the state and the batch are
`jax.ShapeDtypeStruct`s (as `train.state.abstract_state` builds them), so lowering and compiling
cost seconds."""

import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import packed
from train import sharding as sharding_lib
from train import steps as steps_lib
from train import state as state_lib

VOCAB = 8192  # the full built-in corpus's tokenizer
H100_BYTES = 80e9
BATCH_KEYS = ("input_ids", "segment_ids", "segment_positions", "labels")
FLASH_KERNELS = ("segment_flash_fwd", "segment_flash_bwd_dq", "segment_flash_bwd_dkv")


def named_config(name, **overrides):
  """`packed.get_config(name)` with `overrides` set, keyed `"group.name"`."""
  c = packed.get_config(name)
  with c.unlocked():
    for key, value in overrides.items():
      group, field = key.split(".")
      c[group][field] = value
  return c


def abstract_step(config, mesh, *, batch_keys=BATCH_KEYS, sharded=False):
  """The trainer's jitted step traced on abstract `(state, batch)` over `mesh`.

  Args:
    config: the trainer config.
    mesh: the device mesh of the state.
    batch_keys: the batch's arrays, each int32 `[batch_size, seq_len]`.
    sharded: jit with the trainer's shardings of the state and batch (default: none given).

  Returns:
    `(traced step, abstract state)`.
  """
  tx, schedule = steps_lib.make_optimizer(config.train)
  graphdef, abstract, _ = state_lib.abstract_state(config, tx, vocab_size=VOCAB, mesh=mesh)
  shardings = {}
  if sharded:
    params_sh = sharding_lib.param_shardings(abstract["params"], mesh)
    replicated = NamedSharding(mesh, P())
    state_sh = dict(params=params_sh, step=replicated,
                    opt_state=sharding_lib.opt_state_shardings(tx, abstract["params"], params_sh,
                                                               mesh))
    shardings = dict(in_shardings=(state_sh, sharding_lib.batch_sharding(mesh)),
                     out_shardings=(state_sh, replicated))
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule,
                                           accum=config.train.grad_accum_steps),
                 donate_argnums=(0,), **shardings)
  rows = jax.ShapeDtypeStruct((config.train.batch_size, config.packing.seq_len), jnp.int32)
  return step.trace(abstract, {k: rows for k in batch_keys}), abstract


def cuda_text_with_triton_kernels(traced, *, num_layers):
  """The step lowered for `cuda`, checked to call only Triton, every layer's three flash kernels
  (forward, dQ, dK/dV; the micro-batch scan body is lowered once)."""
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  assert calls and set(calls) == {"__gpu$xla.gpu.triton"}, set(calls)
  for kernel in FLASH_KERNELS:
    assert len(re.findall(kernel + r"\b", text)) >= num_layers, kernel
  return text


def step_memory_by_layers(name, build_step):
  """XLA's buffer assignment of the config's step (CPU compile, Pallas in interpret mode) at 1
  and 2 layers.

  Args:
    name: the config of `packed.get_config`.
    build_step: `abstract_step` of a config with its mesh, returning `(traced, abstract state)`.

  Returns:
    `{layers: (argument bytes, temporary bytes, total bytes)}` for 1 and 2 layers, the total
    being arguments + outputs - aliased + temporaries. Checked: the arguments hold the float32
    parameters and Adam's two moments (plus the batch and the step), and the donated state is
    updated in place.
  """
  parts = {}
  for layers in (1, 2):
    c = named_config(name, **{"model.num_layers": layers, "attention.interpret": True})
    traced, abstract = build_step(c)
    mem = traced.lower().compile().memory_analysis()
    state_bytes = 3 * 4 * sum(x.size for x in jax.tree.leaves(abstract["params"]))
    assert state_bytes <= mem.argument_size_in_bytes <= state_bytes + 2**21
    assert mem.alias_size_in_bytes >= state_bytes
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes)
    parts[layers] = (mem.argument_size_in_bytes, mem.temp_size_in_bytes, total)
  return parts


def extrapolate(one, two, *, layers):
  """The value at `layers` on the line through the values at 1 and 2 layers."""
  return one + (layers - 1) * (two - one)

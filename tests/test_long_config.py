"""`configs/packed.py:long` proven on the CPU: 131,072-slot rows split over 8 devices (context
parallelism), its step lowered for `cuda` with the Pallas (Triton) context-parallel kernels, and
its memory per device against an 80 GB H100.

As in tests/test_gpu_config.py no real arrays of the full model are made: state and batch are
`jax.ShapeDtypeStruct`s, sharded as the trainer shards them over the 8 forced CPU devices
(tests/conftest.py) standing in for the 8 GPUs.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import packed
from train import config_checks
from train import sharding as sharding_lib
from train import train as train_lib

VOCAB = 8192  # the full built-in corpus's tokenizer
H100_BYTES = 80e9
SLOTS_PER_DEVICE = 131_072 // 8


def _long_config(**overrides):
  c = packed.get_config("long")
  with c.unlocked():
    for key, value in overrides.items():
      group, name = key.split(".")
      c[group][name] = value
  return c


def _abstract_step(config):
  """The trainer's jitted step with its shardings, on abstract `(state, batch in context order)`."""
  m = config.mesh
  mesh = sharding_lib.make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, context=m.context)
  tx, schedule = train_lib.make_optimizer(config.train)
  abstract_state = train_lib._abstract_state  # pylint: disable=protected-access
  graphdef, abstract = abstract_state(config, VOCAB, tx, mesh)
  params_sh = sharding_lib.param_shardings(abstract["params"], mesh)
  replicated = NamedSharding(mesh, P())
  state_sh = dict(params=params_sh, step=replicated,
                  opt_state=sharding_lib.opt_state_shardings(tx, abstract["params"], params_sh,
                                                             mesh))
  step = jax.jit(train_lib.make_train_step(graphdef, tx, schedule,
                                           accum=config.train.grad_accum_steps),
                 in_shardings=(state_sh, sharding_lib.batch_sharding(mesh)),
                 out_shardings=(state_sh, replicated), donate_argnums=(0,))
  rows = jax.ShapeDtypeStruct((config.train.batch_size, config.packing.seq_len), jnp.int32)
  batch = {k: rows for k in ("input_ids", "segment_ids", "segment_positions", "labels",
                             "slot_index")}
  return step.trace(abstract, batch), abstract


def test_long_config_splits_131072_slot_rows_over_8_devices():
  c = packed.get_config("long")
  assert (c.packing.seq_len, c.mesh.context, c.mesh.data, c.attention.implementation) == (
      131_072, 8, 1, "pallas")
  assert c.model.to_dict() == packed.get_config("gpu").model.to_dict()
  config_checks.check_config(c)
  assert jax.device_count() == 8


def test_long_train_step_lowers_for_cuda_with_the_context_parallel_pallas_kernels():
  c = packed.get_config("long")
  traced, _ = _abstract_step(c)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  assert calls and set(calls) == {"__gpu$xla.gpu.triton"}, set(calls)
  for kernel in ("segment_flash_fwd", "segment_flash_bwd_dq", "segment_flash_bwd_dkv"):
    assert len(re.findall(kernel + r"\b", text)) >= c.model.num_layers, kernel
  # Per device: 16,384 query slots of one row; keys and values gathered over `context`, their
  # gradients reduce-scattered back; no [S, S] (or [S / 8, S]) mask anywhere.
  assert f"tensor<1x{SLOTS_PER_DEVICE}x12x64xbf16>" in text
  assert len(re.findall(r"all_gather", text)) >= 2 * c.model.num_layers
  assert len(re.findall(r"reduce_scatter", text)) >= 2 * c.model.num_layers
  assert "131072x131072" not in text and f"{SLOTS_PER_DEVICE}x131072" not in text


@pytest.mark.slow
def test_long_step_memory_per_device_fits_an_80gb_h100():
  """XLA's buffer assignment of one device's share of the step (CPU compile of the 8-device SPMD
  program, Pallas in interpret mode), 1 and 2 layers compiled and extrapolated linearly to 16 as
  for `:gpu` (docs/training.md, "The `:long` config's memory")."""
  totals, parts = {}, {}
  for layers in (1, 2):
    c = _long_config(**{"model.num_layers": layers, "attention.interpret": True})
    traced, abstract = _abstract_step(c)
    mem = traced.lower().compile().memory_analysis()
    # Arguments: float32 parameters and Adam's two moments, replicated on every device.
    state_bytes = 3 * 4 * sum(x.size for x in jax.tree.leaves(abstract["params"]))
    assert state_bytes <= mem.argument_size_in_bytes <= state_bytes + 2**21
    assert mem.alias_size_in_bytes >= state_bytes  # the donated state is updated in place
    totals[layers] = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                      - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    parts[layers] = (mem.argument_size_in_bytes, mem.temp_size_in_bytes, totals[layers])
  layers = packed.get_config("long").model.num_layers
  xla_bytes = totals[1] + (layers - 1) * (totals[2] - totals[1])
  for name, one, two in zip(("arguments", "temporaries", "total"), parts[1], parts[2]):
    full = one + (layers - 1) * (two - one)
    print(f"long config per device, {name}: 1 layer {one / 1e9:.2f} GB, each further layer "
          f"{(two - one) / 1e9:.2f} GB, {layers} layers {full / 1e9:.2f} GB")
  assert 10e9 < xla_bytes < 0.75 * H100_BYTES

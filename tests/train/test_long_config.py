"""`configs/packed.py:long` proven on the CPU: 131,072-slot rows split over 8 devices (context
parallelism), its step lowered for `cuda` with the Pallas (Triton) context-parallel kernels, and
its memory per device against an 80 GB H100.

As in tests/train/test_gpu_config.py no real arrays of the full model are made (tests/support/config_steps.py):
state and batch are `jax.ShapeDtypeStruct`s, sharded as the trainer shards them over the 8 forced
CPU devices (tests/conftest.py) standing in for the 8 GPUs.
"""

import re

import jax
import pytest

from configs import packed
from train import config_checks
from train import sharding as sharding_lib

from support.config_steps import BATCH_KEYS
from support.config_steps import H100_BYTES
from support.config_steps import abstract_step
from support.config_steps import cuda_text_with_triton_kernels
from support.config_steps import extrapolate
from support.config_steps import step_memory_by_layers

SLOTS_PER_DEVICE = 131_072 // 8


def _abstract_step(config):
  """The trainer's jitted step with its shardings, on abstract `(state, batch in context order)`."""
  m = config.mesh
  mesh = sharding_lib.make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, context=m.context)
  return abstract_step(config, mesh, batch_keys=BATCH_KEYS + ("slot_index",), sharded=True)


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
  text = cuda_text_with_triton_kernels(traced, num_layers=c.model.num_layers)
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
  parts = step_memory_by_layers("long", _abstract_step)
  layers = packed.get_config("long").model.num_layers
  xla_bytes = extrapolate(parts[1][2], parts[2][2], layers=layers)
  for name, one, two in zip(("arguments", "temporaries", "total"), parts[1], parts[2]):
    full = extrapolate(one, two, layers=layers)
    print(f"long config per device, {name}: 1 layer {one / 1e9:.2f} GB, each further layer "
          f"{(two - one) / 1e9:.2f} GB, {layers} layers {full / 1e9:.2f} GB")
  assert 10e9 < xla_bytes < 0.75 * H100_BYTES

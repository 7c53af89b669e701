"""The trainer on its mesh of explicit axes (`jax.make_mesh`'s default) on 8 CPU devices.

Every parallelism the config offers (data, fsdp, tensor, context, gradient accumulation; XLA and
Pallas-interpret attention; tied embeddings, q/k/v biases, q/k norms; both loss weightings;
per-source losses) must give one training step's loss, metrics and updated parameters and
optimizer state of one device running the same step on the same batch in row order, to float
tolerance. The state, the batch and every array of the step are typed with the mesh's explicit
shardings (the partitioner does not choose them), and the updated state keeps the shardings of
`train.sharding` (the ZeRO-3 gathers transpose back into the parameters' splits). (The decoder's
splits and an imported checkpoint on these meshes: tests/train/test_explicit_mesh_placement.py.)
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from support.train_configs import synthetic_config

from train import context_batches as context_lib
from train import data as data_lib
from train.model import decoder as model_lib
from train import sharding as sharding_lib
from train import steps as steps_lib
from train import setup as setup_lib
from train.objective import TokenObjective

EXPLICIT = AxisType.Explicit
NUM_SOURCES = 2  # the "sources" cases' per-source losses: each slot's source is its segment % 2


def _config(**overrides):
  """A tiny float32 synthetic run: E=32, H=4, K=2, D=8, F=64, V=128 (splits over 2 and 4)."""
  return synthetic_config(**{"model.num_layers": 2, "model.dtype": "float32",
                       "model.vocab_size": 128, "attention.implementation": "xla",
                       "attention.self_check": False, "train.eval_every": 0,
                       "train.log_batches": False, **overrides})


CASES = {
    "data8": {},
    # data 2 x fsdp 2 x tensor 2 alone is also the mesh of "tied_bias_norm_sequence" and "pallas".
    "fsdp8": {"mesh.data": 1, "mesh.fsdp": 8},
    # K=2 does not divide over 4: the heads stay whole, F=64 and V=128 split over 4.
    "tensor4": {"mesh.data": 2, "mesh.tensor": 4},
    "context_tensor": {"mesh.data": 2, "mesh.context": 2, "mesh.tensor": 2},
    "context4_fsdp": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 4},
    # Accumulation over fsdp and tensor: "sources_context_accumulation" (with context too).
    # fsdp=1: the micro-batch reshape must keep the one-device axis on the rows.
    "accumulation_data8": {"train.batch_size": 16, "train.grad_accum_steps": 2},
    "tied_bias_norm_sequence": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                                "model.tie_embeddings": True, "model.qkv_bias": True,
                                "model.qk_norm": True, "loss.weighting": "sequence"},
    "sources_context_accumulation": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 2,
                                     "mesh.tensor": 2, "train.batch_size": 16,
                                     "train.grad_accum_steps": 2, "loss.weighting": "sequence"},
    "pallas": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
               "attention.implementation": "pallas", "attention.interpret": True},
    "pallas_context": {"mesh.data": 2, "mesh.context": 2, "mesh.tensor": 2,
                       "attention.implementation": "pallas", "attention.interpret": True},
}


def _with_sources(batch):
  """The batch with `segment_sources` (segment id % 2, -1 on padding), as a mixture's rows."""
  seg = np.asarray(batch["segment_ids"])
  return dict(batch, segment_sources=np.where(seg > 0, seg % NUM_SOURCES, -1).astype(np.int32))


def _step(config, mesh, state, batch, *, num_sources):
  """One jitted train step of `config` on `mesh` (None: one device, no mesh)."""
  t = config.train
  graphdef = nnx.split(nnx.eval_shape(lambda: model_lib.build(
      config, t.seed, vocab_size=config.model.vocab_size, mesh=mesh)))[0]
  tx, schedule = steps_lib.make_optimizer(t)
  objective = TokenObjective(weighting=config.loss.weighting,
                             source_names=tuple(f"s{i}" for i in range(num_sources)))
  step = steps_lib.make_train_step(graphdef, tx, schedule, accum=t.grad_accum_steps,
                                   objective=objective)
  return jax.jit(step)(state, batch)


def _assert_explicit(tree, mesh):
  for leaf in jax.tree.leaves(tree):
    sharding = jax.typeof(leaf).sharding
    assert sharding.mesh.axis_types == (EXPLICIT,) * 4, sharding
    assert dict(sharding.mesh.shape) == dict(mesh.shape)


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_on_the_explicit_mesh_equals_one_device(tmp_path, name):
  overrides = CASES[name]
  config = _config(**overrides)
  run = setup_lib.setup(config, str(tmp_path))
  assert run.mesh.axis_types == (EXPLICIT,) * 4
  sizes = {k.split(".")[1]: v for k, v in overrides.items() if k.startswith("mesh.")}
  assert all(run.mesh.shape[axis] == size for axis, size in sizes.items())
  num_sources = NUM_SOURCES if name.startswith("sources") else 0
  local = data_lib.next_batch(run.iterator)  # in context order with mesh.context > 1
  if num_sources:
    local = _with_sources(local)
  before = jax.device_get(run.state)
  batch = sharding_lib.global_batch(local, run.mesh)
  _assert_explicit([batch, run.state], run.mesh)
  state, metrics = _step(config, run.mesh, run.state, batch, num_sources=num_sources)
  _assert_explicit([state, metrics], run.mesh)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(run.state_shardings)):
    assert got.sharding.is_equivalent_to(want, got.ndim)  # the fsdp / tensor splits are kept
  want_state, want_metrics = _step(config, None, before, context_lib.row_order(local),
                                   num_sources=num_sources)
  assert float(metrics["finite"]) == 1.0 and float(want_metrics["loss"]) > 1.0
  for key, value in want_metrics.items():
    # Measured: at most 2e-7 relative (summation order).
    np.testing.assert_allclose(np.asarray(metrics[key]), np.asarray(value), rtol=2e-6,
                               atol=1e-7, err_msg=key)
  for got, want in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)  # measured: 2.1e-9 absolute


def test_the_trainers_mesh_has_explicit_axes():
  """`train.sharding.make_mesh` builds what `jax.make_mesh` makes by default, also over a
  subset of the devices."""
  assert set(jax.make_mesh((8,), ("data",)).axis_types) == {EXPLICIT}
  mesh = sharding_lib.make_mesh(data=2, fsdp=2, tensor=2)
  assert mesh.axis_types == (EXPLICIT,) * 4 and mesh.axis_names == sharding_lib.AXES
  one = sharding_lib.make_mesh(data=1, devices=jax.devices()[:1])
  assert one.axis_types == (EXPLICIT,) * 4 and one.devices.size == 1

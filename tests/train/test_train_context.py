"""Context parallelism in the trainer (`mesh.context`, `packing.context_balance`) on 8 CPU devices.

The oracle is the same trainer at `mesh.context=1`, where rows stay in row order and attention
uses its ordinary causal mask: splitting every row over 4 devices in a balanced slot order must
give the same losses, the same batches and a checkpoint either mesh can resume.
"""

import json

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from train import config_checks
from train import metrics as metrics_lib
from train import sharding as sharding_lib
from train import train as train_lib
from train import setup as setup_lib

from support.train_configs import synthetic_config

STEPS = 3


def _config(**overrides):
  """A tiny float32 synthetic run, XLA attention, one loss record per step."""
  return synthetic_config(**{
      "model.num_layers": 1, "model.dtype": "float32", "attention.implementation": "xla",
      "attention.self_check": False, "train.num_steps": STEPS, "train.eval_every": STEPS,
      "train.checkpoint_every": 0,  # only at the end
      **overrides})


def _losses(workdir, kind="train", key="loss"):
  return {r["step"]: r[key] for r in metrics_lib.read(workdir) if r["kind"] == kind}


def _fingerprints(workdir):
  with open(workdir / "batches.jsonl") as f:
    return [(r["step"], r["fingerprint"], r["position"]) for r in map(json.loads, f)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  """Three steps at `mesh.context=1` (8-way data parallel)."""
  workdir = tmp_path_factory.mktemp("context1")
  train_lib.train_and_evaluate(_config(), str(workdir))
  return workdir


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["zigzag", "documents"])
def test_context_4_gives_the_losses_of_context_1(baseline, tmp_path, balance):
  config = _config(**{"mesh.data": 2, "mesh.context": 4, "packing.context_balance": balance})
  run = setup_lib.setup(config, str(tmp_path / "probe"))
  assert dict(run.mesh.shape) == {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}
  assert sharding_lib.batch_sharding(run.mesh).spec == P(("data", "fsdp"), "context")
  batch, plain = next(run.iterator), run.data.train[0]  # step 1, in context and in row order
  order = batch["slot_index"]
  assert np.array_equal(np.sort(order, axis=1), np.broadcast_to(np.arange(64), order.shape))
  assert not np.array_equal(order, np.sort(order, axis=1))  # reordered, not the identity
  assert set(batch) == set(plain) | {"slot_index"}
  for key, value in plain.items():  # every feature moved with its slot
    assert np.array_equal(batch[key], np.take_along_axis(value, order.astype(np.int64), axis=1))
  on_device = sharding_lib.global_batch(batch, run.mesh)["input_ids"]
  assert on_device.sharding.shard_shape(on_device.shape) == (4, 16)  # 64 slots over 4 devices

  workdir = tmp_path / "context4"
  train_lib.train_and_evaluate(config, str(workdir))
  want, got = _losses(baseline), _losses(workdir)
  assert sorted(got) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)],
                             rtol=1e-5)
  want, got = _losses(baseline, key="grad_norm"), _losses(workdir, key="grad_norm")
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)],
                             rtol=1e-4)
  np.testing.assert_allclose(_losses(workdir, "eval", "eval_loss")[STEPS],
                             _losses(baseline, "eval", "eval_loss")[STEPS], rtol=1e-5)
  # The same batches (hashed in row order) from the same data positions.
  assert _fingerprints(workdir) == _fingerprints(baseline)


@pytest.mark.slow
def test_a_context_1_checkpoint_resumes_at_context_2(baseline, tmp_path):
  workdir = tmp_path / "resumed"
  train_lib.train_and_evaluate(_config(**{"train.num_steps": 2}), str(workdir))
  summary = train_lib.train_and_evaluate(
      _config(**{"mesh.context": 2, "packing.context_balance": "documents"}), str(workdir))
  assert summary["resumed_from"] == 2
  want, got = _losses(baseline), _losses(workdir)
  assert sorted(got) == list(range(1, STEPS + 1))
  np.testing.assert_allclose(got[3], want[3], rtol=1e-5)
  np.testing.assert_allclose(_losses(workdir, "eval", "eval_loss")[STEPS],
                             _losses(baseline, "eval", "eval_loss")[STEPS], rtol=1e-5)
  assert _fingerprints(workdir) == _fingerprints(baseline)


@pytest.mark.parametrize("seq_len, context, balance, need", [
    (64, 3, "zigzag", "2 * mesh.context = 6"),
    (60, 4, "documents", "2 * mesh.context = 8"),
    (62, 4, "none", "mesh.context = 4"),
])
def test_a_row_that_does_not_split_is_refused_naming_the_keys(tmp_path, seq_len, context,
                                                              balance, need):
  config = _config(**{"packing.seq_len": seq_len, "mesh.context": context,
                      "packing.context_balance": balance})
  with pytest.raises(config_checks.ConfigError) as e:
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert str(e.value) == (f"packing.seq_len={seq_len} must be divisible by {need} with "
                          f"packing.context_balance={balance!r}")
  assert "\n" not in str(e.value) and not list(tmp_path.iterdir())
  # The same row splits over 4 devices without chunk pairs, and over 1 always.
  config_checks.check_config(_config(**{"packing.seq_len": 60, "mesh.context": 4,
                                        "packing.context_balance": "none"}))
  config_checks.check_config(_config(**{"packing.seq_len": seq_len}))

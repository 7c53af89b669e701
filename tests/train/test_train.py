"""End-to-end tests of the trainer: smoke run, exact resume after kill -9, sharding, bad input."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import packed, padded
from train import checkpoint_compat as ckpt_compat
from train import metrics as metrics_lib
from train.model import config as model_config
from train.model import decoder as model_lib
from train import sharding as sharding_lib
from train import train as train_lib
from train import run_guard
from train import config_checks
from train import steps as steps_lib
from train import setup as setup_lib
from support.train_configs import WITHOUT_TORCH, synthetic_config
from support import paths
from support import train_configs

REPO = str(paths.REPO)


def _records(workdir, kind):
  return [r for r in metrics_lib.read(workdir) if r["kind"] == kind]


def _batches(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


_CHILD = WITHOUT_TORCH + """
import json, os, signal, sys
from train import metrics as M
from train import train as T
from support.train_configs import synthetic_config
kill_at = int(sys.argv[2])
if kill_at:
  log = M.log_batch
  def log_then_die(path, step, local, *info):
    log(path, step, local, *info)
    if step == kill_at:
      os.kill(os.getpid(), signal.SIGKILL)
  M.log_batch = log_then_die
c = synthetic_config(**{"train.num_steps": 9, "train.checkpoint_every": 3, "train.eval_every": 0})
print(json.dumps(T.train_and_evaluate(c, sys.argv[1])))
"""


def _child(workdir, kill_at):
  """Starts a 1-device training subprocess that SIGKILLs itself after fetching batch `kill_at`."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
             XLA_FLAGS=train_configs.one_cpu_device())
  return subprocess.Popen([sys.executable, "-c", _CHILD, str(workdir), str(kill_at)], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(proc, returncode):
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == returncode, err[-3000:]
  return out


@pytest.mark.slow
def test_kill_minus_9_then_resume_sees_the_same_batches(tmp_path):
  work = tmp_path / "killed"
  straight = _child(tmp_path / "straight", 0)
  _wait(_child(work, 5), -9)  # killed between checkpoints 3 and 6 ...
  _wait(_child(work, 7), -9)  # ... then again after resuming from 3
  resumed = _wait(_child(work, 0), 0)
  assert json.loads(resumed.strip().splitlines()[-1])["resumed_from"] == 6
  _wait(straight, 0)
  want = {b["step"]: b["fingerprint"] for b in _batches(tmp_path / "straight" / "batches.jsonl")}
  assert sorted(want) == list(range(1, 10)) and len(set(want.values())) == 9

  seen = _batches(work / "batches.jsonl")
  assert {b["step"] for b in seen} == set(want)  # nothing dropped
  for b in seen:  # and every step, including the replayed ones, saw the same batch
    assert b["fingerprint"] == want[b["step"]], b["step"]
  # Steps after the last checkpoint are replayed: 4, 5 (ckpt 3), then 7 (ckpt 6).
  assert [b["step"] for b in seen] == [1, 2, 3, 4, 5, 4, 5, 6, 7, 7, 8, 9]
  # Identical data + restored optimizer state: the same losses as the straight run.
  final = {r["step"]: r["loss"] for r in _records(tmp_path / "straight", "train")}
  for r in _records(work, "train"):
    np.testing.assert_allclose(r["loss"], final[r["step"]], rtol=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_is_exact():
  cfg = model_config.DecoderConfig(vocab_size=50, num_layers=1, d_model=16, num_heads=2,
                                num_kv_heads=1, head_dim=8, d_ff=32)
  graphdef, params = nnx.split(model_lib.Decoder(cfg, rngs=nnx.Rngs(params=0)))
  tx, schedule = steps_lib.make_optimizer(synthetic_config().train)
  rng = np.random.default_rng(0)
  seg = np.sort(rng.integers(0, 4, size=(8, 16)), axis=1).astype(np.int32)
  labels = np.where(seg > 0, rng.integers(0, 50, size=(8, 16)), -100).astype(np.int32)
  labels[:3] = -100  # rows without trained tokens unbalance the micro-batches
  labels[3, :2] = -100
  batch = dict(input_ids=jnp.asarray(rng.integers(0, 50, size=(8, 16)), jnp.int32),
               segment_ids=jnp.asarray(seg), segment_positions=jnp.zeros((8, 16), jnp.int32),
               labels=jnp.asarray(labels))
  state = dict(params=params, opt_state=tx.init(params), step=jnp.int32(3))
  results = [jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=a))(state, batch)
             for a in (1, 2, 4)]
  for new_state, metrics in results[1:]:
    np.testing.assert_allclose(metrics["loss"], results[0][1]["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], results[0][1]["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_state["params"]), jax.tree.leaves(results[0][0]["params"])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_fsdp_tensor_mesh_matches_data_parallel(tmp_path):
  """data x fsdp x tensor = 2 x 2 x 2 gives the losses of pure data parallelism (8)."""
  single = synthetic_config(**{"train.num_steps": 3, "train.eval_every": 0, "train.log_batches": False})
  sharded = synthetic_config(**{"train.num_steps": 3, "train.eval_every": 0, "train.log_batches": False,
                          "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
  mesh = sharding_lib.make_mesh(data=2, fsdp=2, tensor=2)
  assert sharding_lib.param_spec("layers/0/attn/q/kernel", (32, 32), mesh) == \
      jax.sharding.PartitionSpec("fsdp", "tensor")
  assert sharding_lib.param_spec("layers/0/mlp/down/kernel", (64, 32), mesh) == \
      jax.sharding.PartitionSpec("tensor", "fsdp")
  assert sharding_lib.param_spec("embed/embedding", (97, 32), mesh) == \
      jax.sharding.PartitionSpec(None, "fsdp")  # 97 rows do not split over tensor=2
  run = setup_lib.setup(sharded, str(tmp_path / "probe"))
  q = run.state["params"]["layers"][0]["attn"]["q"]["kernel"]
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  mu = run.state["opt_state"][1][0].mu["layers"][0]["attn"]["q"]["kernel"]
  assert mu.sharding.spec == q.sharding.spec  # optimizer moments follow their parameters
  train_lib.train_and_evaluate(single, str(tmp_path / "single"))
  train_lib.train_and_evaluate(sharded, str(tmp_path / "sharded"))
  a = [r["loss"] for r in _records(tmp_path / "single", "train")]
  b = [r["loss"] for r in _records(tmp_path / "sharded", "train")]
  np.testing.assert_allclose(a, b, rtol=2e-5)


def test_configs_share_model_and_budget():
  a, b = packed.get_config(), padded.get_config()
  assert a.packing.strategy == "ffd" and b.packing.strategy == "pad"
  with b.unlocked():
    b.packing.strategy = "ffd"
  assert a.to_dict() == b.to_dict()
  assert packed.get_config("smoke").data.size == "small"


def test_config_typo_is_refused_naming_the_key():
  c = packed.get_config()
  with pytest.raises(AttributeError, match="num_stpes"):
    c.train.num_stpes = 3
  with pytest.raises(ValueError, match="'smok'"):
    packed.get_config("smok")


def test_batch_not_divisible_by_devices_names_both_numbers(tmp_path):
  c = synthetic_config(**{"train.batch_size": 12})
  with pytest.raises(sharding_lib.MeshConfigError, match=r"12.*8 batch shards"):
    train_lib.train_and_evaluate(c, str(tmp_path))


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(run_guard.WorkdirError, match="a_file"):
    train_lib.train_and_evaluate(synthetic_config(), str(blocker / "run"))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only error")
def test_pallas_on_the_cpu_needs_interpret_mode(tmp_path):
  c = synthetic_config(**{"attention.implementation": "pallas"})
  with pytest.raises(config_checks.AttentionConfigError, match="attention.interpret=True"):
    train_lib.train_and_evaluate(c, str(tmp_path))
  assert not os.listdir(tmp_path)  # refused before anything was written


def test_resume_with_incompatible_config_says_what_differs(tmp_path):
  c = synthetic_config(**{"train.num_steps": 1, "train.eval_every": 0})
  train_lib.train_and_evaluate(c, str(tmp_path))
  other = synthetic_config(**{"train.num_steps": 2, "train.eval_every": 0, "model.d_ff": 96,
                        "train.learning_rate": 1e-3})
  with pytest.raises(ckpt_compat.IncompatibleCheckpointError,
                     match=r"model\.d_ff: checkpoint has 64, config has 96(.|\n)*learning_rate"):
    train_lib.train_and_evaluate(other, str(tmp_path))


def test_cli_refuses_a_config_typo_and_names_the_default_workdir():
  from train import launch as main_lib  # pylint: disable=g-import-not-at-top
  assert main_lib.default_workdir("configs/packed.py:smoke") == os.path.join("runs", "packed_smoke")
  assert main_lib.default_workdir("configs/padded.py") == os.path.join("runs", "padded")
  proc = subprocess.run(
      [sys.executable, "-m", "train.main", "--config=configs/packed.py:smoke",
       "--config.train.num_stpes=3"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and "num_stpes" in proc.stderr


@pytest.mark.slow
def test_bench_json_compares_packed_and_padded_on_the_same_tokens(capsys):
  """`python -m train.bench packed --json` prints one object with both real-token rates, measured on
  exactly the same documents (equal real tokens), packing taking no more steps than padding."""
  from train.bench import training as bench  # pylint: disable=g-import-not-at-top
  assert bench.main(["packed", "--size", "small", "--docs", "12", "--seq-len", "128",
                     "--batch-size", "8", "--json"]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  for key in ("packed_real_tokens_per_s", "padded_real_tokens_per_s", "speedup"):
    assert np.isfinite(out[key]) and out[key] > 0, key
  assert out["packed_real_tokens"] == out["padded_real_tokens"]
  assert out["packed_real_tokens"] == out["doc_tokens"] + 2 * out["documents"]  # + BOS, EOS
  assert out["packed_steps"] <= out["padded_steps"]
  assert out["packed_slot_utilization"] > out["padded_slot_utilization"]
  np.testing.assert_allclose(
      out["speedup"], out["packed_real_tokens_per_s"] / out["padded_real_tokens_per_s"])

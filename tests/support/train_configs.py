"""Small trainer configs and runs shared by the trainer tests: a smoke config on synthetic
documents, a one-step run, a `python -m` command of this checkout."""

import os
import subprocess
import sys

from configs import packed
from support.paths import REPO
from train import train as train_lib


def synthetic_config(**overrides):
  """A smoke config on synthetic documents (no corpus build), unlocked for the overrides."""
  c = packed.get_config("smoke")
  with c.unlocked():
    c.data.source = "synthetic"
    c.data.synthetic_docs = 300
    c.data.synthetic_mean_len = 30
    c.data.synthetic_vocab = 97
    c.packing.seq_len = 64
    c.model.d_model = 32
    c.model.head_dim = 8
    c.model.d_ff = 64
    c.train.eval_batches = 1
    for key, value in overrides.items():
      group, name = key.split(".")
      c[group][name] = value
  return c


# The first line of a training child process (`python -c`) that needs no PyTorch: tensorboardX
# imports torch whenever it is installed (about 1.5 s of CPU per process), and falls back to
# numpy when the import fails; the trainer itself never uses it.
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None\n"


def one_step_run(config, workdir):
  """Trains `config` for one step in `workdir`: no evaluation, batch log or attention self-check
  (tests/train/sample/test_sample_chat.py's run too)."""
  config.train.num_steps = 1
  config.train.eval_every = 0
  config.train.log_batches = False
  config.attention.self_check = False
  train_lib.train_and_evaluate(config, str(workdir))


def short_run(config, workdir, *, steps=3):
  """Trains `config` for `steps` steps of 8 rows in `workdir` with XLA attention: no evaluation,
  checkpoint only at the end, no batch log (the export and sampler tests' runs)."""
  config.attention.implementation = "xla"
  config.attention.self_check = False
  t = config.train
  t.batch_size, t.num_steps, t.warmup_steps, t.log_every = 8, steps, 1, 1
  t.eval_every, t.checkpoint_every, t.log_batches = 0, 0, False
  train_lib.train_and_evaluate(config, str(workdir))


def one_cpu_device() -> str:
  """The tests' XLA_FLAGS without `--xla_force_host_platform_device_count`: one CPU device, as a
  user's machine has (the tests' eight are for the tests of meshes)."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  return " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count"))


def run_cli(*args, cwd=REPO, check=True, env=None):
  """Runs `python -m ARGS` from `cwd` on one CPU device (unless `env` names XLA_FLAGS); a failure
  fails the test when `check`."""
  env = dict(os.environ, PYTHONPATH=str(REPO), **{"XLA_FLAGS": one_cpu_device(), **(env or {})})
  out = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=900)
  if check:
    assert out.returncode == 0, out.stderr[-3000:]
  return out

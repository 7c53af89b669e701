"""Small trainer configs and runs shared by the trainer tests: a smoke config on synthetic
documents, a LoRA config on a Hugging Face base, a one-step run, a run on several local
processes, a `python -m` command of this checkout."""

import os
import subprocess
import sys

import portpicker

from configs import packed
from support.paths import REPO
from train import train as train_lib
from train.hf import config as hf_config


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


def lora_config(base_dir, data_dir, *, steps, rank=4, targets="all", lr=3e-2,
                constant_rate=False, **lora):
  """LoRA (all seven projections by default) on the Hugging Face model `base_dir`, rows of 128
  from `data_dir`, batch 8, XLA attention, a log line per step and nothing else; a constant
  learning rate when `constant_rate` (a 2-step run's schedule is then a 4-step run's)."""
  config = packed.get_config()
  config.model.init_from = base_dir
  config.data.train = data_dir
  config.packing.seq_len = 128
  config.attention.implementation = "xla"
  config.attention.self_check = False
  t = config.train
  t.batch_size, t.num_steps, t.log_every, t.eval_every, t.checkpoint_every = 8, steps, 1, 0, 0
  t.learning_rate, t.warmup_steps, t.log_batches = lr, 0, False
  t.min_lr_ratio = 1.0 if constant_rate else t.min_lr_ratio
  config.model.lora.rank, config.model.lora.alpha = rank, 8.0
  config.model.lora.targets = targets
  for key, value in lora.items():
    config.model.lora[key] = value
  hf_config.adopt(config)
  return config


_PROCESS = WITHOUT_TORCH + """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
count, index, port, workdir, expression = sys.argv[1:6]
if int(count) > 1:
  jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=int(count),
                             process_id=int(index))
from support import train_configs
from train import train as T
print(json.dumps(T.train_and_evaluate(eval(expression, vars(train_configs)), workdir)))
"""


def train_on_processes(workdir, expression, *, count, devices=8):
  """Trains `workdir` on `count` local CPU processes (`jax.distributed` over gloo, `devices` in
  all) with the config that `expression` makes in this module's namespace (e.g.
  `"lora_config('base', 'data', steps=2)"`); returns process 0's output."""
  port = str(portpicker.pick_unused_port())
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
             XLA_FLAGS=cpu_devices(devices // count),
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, str(count), str(i), port,
                             str(workdir), expression], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(count)]
  outs = []
  try:
    for proc in procs:
      out, err = proc.communicate(timeout=300)
      assert proc.returncode == 0, err[-4000:]
      outs.append(out)
  finally:
    for proc in procs:
      proc.kill()
  return outs[0]


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


def cpu_devices(count: int) -> str:
  """The tests' XLA_FLAGS (tests/conftest.py's compile options kept) with `count` CPU devices."""
  return f"{one_cpu_device()} --xla_force_host_platform_device_count={count}".strip()


def run_cli(*args, cwd=REPO, check=True, env=None, python=sys.executable):
  """Runs `python -m ARGS` from `cwd` on one CPU device (unless `env` names XLA_FLAGS), with
  `python` (another environment's, e.g. `support.fresh_env.make`'s); a failure fails the test
  when `check`."""
  env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": one_cpu_device(), **(env or {})}
  out = subprocess.run([str(python), "-m", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=900)
  if check:
    assert out.returncode == 0, out.stderr[-3000:]
  return out

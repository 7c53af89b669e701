"""Two local CPU processes (jax.distributed, gloo collectives) train like one process.

Each process owns 2 CPU devices and reads its own block of every global batch of the row stream.
Their rows must be disjoint, together be exactly the single process's rows, and the loss of every
step must equal the loss of one 4-device process on the same global batch. (Resuming on another
process count: tests/train/test_elastic.py.) The two processes then export the run to Hugging
Face files together (each gathers the parameters split over both); the files must be, byte for
byte, those that one process exporting the same checkpoint writes.
"""

import json
import os
import subprocess
import sys

import numpy as np
import portpicker
import pytest
from support import paths
from support import train_configs
from train.export import command as hf_export
from support.train_configs import WITHOUT_TORCH

REPO = str(paths.REPO)
EXPORT_SHARD_BYTES = 30_000  # The tiny model's 0.1 MB in several files, with their index.

_CHILD = WITHOUT_TORCH + """
import json, os, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
workdir, port = sys.argv[1], sys.argv[4]
num_processes, process_id = int(sys.argv[2]), int(sys.argv[3])
if num_processes > 1:
  jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                             num_processes=num_processes, process_id=process_id)
from train import train as T
from support.train_configs import synthetic_config
c = synthetic_config(**{"train.num_steps": 3, "train.eval_every": 3, "train.checkpoint_every": 0})
summary = T.train_and_evaluate(c, workdir)
print("DEVICES", jax.device_count(), jax.local_device_count())
print(json.dumps(summary))
if num_processes > 1:
  from train.export import command as E
  E.export(workdir=workdir, output=workdir + "_export", max_shard_bytes=int(sys.argv[5]))
"""


def _spawn(workdir, num_processes, process_id, port):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
             XLA_FLAGS=train_configs.cpu_devices(2 if num_processes > 1 else 4),
             JAX_PLATFORMS="cpu")
  return subprocess.Popen(
      [sys.executable, "-c", _CHILD, str(workdir), str(num_processes), str(process_id), str(port),
       str(EXPORT_SHARD_BYTES)],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
  try:
    out, err = proc.communicate(timeout=300)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
  assert proc.returncode == 0, err[-4000:]
  return out


def _lines(path, kind=None):
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if kind is None or r.get("kind") == kind]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  port = portpicker.pick_unused_port()
  multi = tmp_path / "multi"
  single = tmp_path / "single"
  procs = [_spawn(multi, 2, i, port) for i in range(2)] + [_spawn(single, 1, 0, 0)]
  outs = [_finish(p) for p in procs]
  assert "DEVICES 4 2" in outs[0] and "DEVICES 4 4" in outs[2]

  rows = [_lines(multi / f"batches.p{i}.jsonl") for i in range(2)]
  whole = _lines(single / "batches.jsonl")
  for step in range(3):
    a, b = set(rows[0][step]["rows"]), set(rows[1][step]["rows"])
    assert len(a) == len(b) == 4 and not a & b  # disjoint halves
    assert a | b == set(whole[step]["rows"])  # together: the single process's global batch

  want = [r["loss"] for r in _lines(single / "metrics.jsonl", "train")]
  got = [r["loss"] for r in _lines(multi / "metrics.jsonl", "train")]
  assert len(want) == 3
  np.testing.assert_allclose(got, want, rtol=1e-5)
  want_eval = _lines(single / "metrics.jsonl", "eval")[-1]["eval_loss"]
  got_eval = _lines(multi / "metrics.jsonl", "eval")[-1]["eval_loss"]
  np.testing.assert_allclose(got_eval, want_eval, rtol=1e-5)

  _check_export(tmp_path, multi)


def _check_export(tmp_path, multi):
  """The two processes' export of `multi` equals one process's, file for file; nothing else is
  left beside it."""
  hf_export.export(workdir=str(multi), output=str(tmp_path / "one_export"),
                   max_shard_bytes=EXPORT_SHARD_BYTES)  # this process
  two = tmp_path / "multi_export"
  names = sorted(p.name for p in two.iterdir())
  assert names == sorted(p.name for p in (tmp_path / "one_export").iterdir())
  assert "model.safetensors.index.json" in names
  assert sum(n.endswith(".safetensors") for n in names) > 1
  for name in names:
    assert (two / name).read_bytes() == (tmp_path / "one_export" / name).read_bytes(), name
  assert sorted(p.name for p in tmp_path.iterdir()) == ["multi", "multi_export", "one_export",
                                                        "single"]

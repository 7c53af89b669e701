"""One run per workdir, a clean stop on SIGINT / SIGTERM, a finished run left alone, a dataset
changed under a run named as such, a mixture's headline eval loss, and TensorBoard scalars.

Every run here is `python -m train.main` in a subprocess on synthetic documents (no corpus
build), as a user runs it; the oracles are the files the runs leave and their exit codes."""

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from train import metrics as metrics_lib
from train import run_guard

REPO = pathlib.Path(__file__).resolve().parents[1]
SYNTHETIC = ["--config=configs/packed.py:smoke", "--config.data.source=synthetic",
             "--config.data.synthetic_docs=300", "--config.data.synthetic_mean_len=30",
             "--config.data.synthetic_vocab=97", "--config.packing.seq_len=64",
             "--config.model.d_model=32", "--config.model.head_dim=8", "--config.model.d_ff=64",
             "--config.train.eval_batches=1", "--config.attention.self_check=False"]


def _env():
  return dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS="--xla_force_host_platform_device_count=1")


def _start(workdir, *extra):
  return subprocess.Popen([sys.executable, "-u", "-m", "train.main", *SYNTHETIC,
                           f"--workdir={workdir}", *extra], cwd=REPO, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(workdir, *extra):
  proc = _start(workdir, *extra)
  out, err = proc.communicate(timeout=600)
  return proc.returncode, out, err


def _wait_for(proc, text, timeout=300):
  """Reads the child's stdout until a line containing `text` (returns the lines read)."""
  lines, deadline = [], time.time() + timeout
  while time.time() < deadline:
    ready, _, _ = select.select([proc.stdout], [], [], 1.0)
    if ready:
      line = proc.stdout.readline()
      if not line and proc.poll() is not None:
        break
      lines.append(line)
      if text in line:
        return lines
  raise AssertionError(f"no line with {text!r} in {lines[-20:]}; stderr {proc.stderr.read()}")


@pytest.mark.slow
def test_a_second_run_on_one_workdir_is_refused_and_a_killed_holder_blocks_nothing(tmp_path):
  first = _start(tmp_path / "run", "--config.train.num_steps=100000")
  _wait_for(first, "step      2")
  rc, _, err = _run(tmp_path / "run", "--config.train.num_steps=100000", "--config.train.seed=1")
  assert rc == 2, err
  line = err.strip()
  assert len(line.splitlines()) == 1 and "is in use by another train.main run" in line
  assert f"pid {first.pid}" in line and "started" in line
  first.kill()
  first.communicate()
  rc, out, err = _run(tmp_path / "run", "--config.train.num_steps=2")  # SIGKILLed: no block
  assert rc == 0, err


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_at_the_step_boundary(tmp_path, signum):
  proc = _start(tmp_path / "run", "--config.train.num_steps=100000",
                "--config.train.checkpoint_every=0", "--config.train.eval_every=0")
  _wait_for(proc, "step      3")
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signum, err[-2000:]
  last = err.strip().splitlines()[-1]
  assert f"stopped by {signal.Signals(signum).name} at step" in last and "to resume" in last
  step = int(last.split(" at step ")[1].split(";")[0])
  assert step >= 3 and (tmp_path / "run" / "checkpoints" / str(step)).is_dir()
  assert "Traceback" not in err
  # The same command resumes at that step; a raised num_steps trains on from there.
  rc, out, err = _run(tmp_path / "run", f"--config.train.num_steps={step + 2}",
                      "--config.train.checkpoint_every=0", "--config.train.eval_every=0")
  assert rc == 0, err
  assert f"resuming at step {step}" in out


@pytest.mark.slow
def test_a_finished_run_started_again_does_nothing(tmp_path):
  rc, _, err = _run(tmp_path / "run", "--config.train.num_steps=2")
  assert rc == 0, err
  before = (tmp_path / "run" / "metrics.jsonl").read_text()
  rc, out, err = _run(tmp_path / "run", "--config.train.num_steps=2")
  assert rc == 0, err
  assert "is finished at step 2 (train.num_steps=2); nothing to do" in out
  assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
  record = json.loads((tmp_path / "run" / run_guard.RECORD_NAME).read_text())
  assert record["config"]["train"]["num_steps"] == 2 and record["config"]["data"]["source"]


def test_the_run_record_refuses_changed_data(tmp_path):
  ds = tmp_path / "ds"
  ds.mkdir()
  (ds / "manifest.json").write_text('{"a": 1}')
  prints = run_guard.data_fingerprints(train=str(ds), eval_path=None)
  run_guard.write_run_record(str(tmp_path), config={"x": 1}, fingerprints=prints)
  run_guard.check_run_record(str(tmp_path), prints)  # unchanged: fine
  (ds / "manifest.json").write_text('{"a": 2}')
  changed = run_guard.data_fingerprints(train=str(ds), eval_path=None)
  with pytest.raises(run_guard.DataChangedError,
                     match=f"the dataset '{ds}' differs from the one this run started with"):
    run_guard.check_run_record(str(tmp_path), changed)


def _tfrecords(path):
  """The events of a TensorBoard event file (TFRecord framing, parsed with tensorboardX's
  protobuf classes)."""
  from tensorboardX.proto import event_pb2
  data, out, i = path.read_bytes(), [], 0
  while i < len(data):
    n = int.from_bytes(data[i:i + 8], "little")
    event = event_pb2.Event()
    event.ParseFromString(data[i + 12:i + 12 + n])
    out.append(event)
    i += 12 + n + 4
  return out


@pytest.mark.slow
def test_metrics_also_go_to_tensorboard(tmp_path):
  rc, _, err = _run(tmp_path / "run", "--config.train.num_steps=3", "--config.train.eval_every=3")
  assert rc == 0, err
  files = list((tmp_path / "run" / metrics_lib.TENSORBOARD_DIR).glob("events.out.tfevents.*"))
  assert len(files) == 1
  scalars = {}
  for event in _tfrecords(files[0]):
    for value in event.summary.value:
      scalars[(value.tag, event.step)] = value.simple_value
  records = metrics_lib.read(tmp_path / "run")
  for r in records:
    if r["kind"] == "train":
      assert scalars[("train/loss", r["step"])] == pytest.approx(r["loss"], rel=1e-6)
    if r["kind"] == "eval":
      assert scalars[("eval/eval_loss", r["step"])] == pytest.approx(r["eval_loss"], rel=1e-6)
  assert any(tag == "train/loss" for tag, _ in scalars)


def test_documented_commands_in_sequence_never_share_a_workdir():
  from train import launch as main_lib
  plain = main_lib.default_workdir("configs/packed.py")
  mine = main_lib.default_workdir("configs/packed.py", {"data.train": "data/mine"})
  other = main_lib.default_workdir("configs/packed.py", {"data.train": "data/other"})
  assert plain == os.path.join("runs", "packed") and len({plain, mine, other}) == 3
  assert mine.startswith(os.path.join("runs", "packed-"))
  # Keys a run resumes across keep the workdir: --config.train.num_steps=50 continues the run.
  assert main_lib.default_workdir("configs/packed.py", {"train.num_steps": 50}) == plain
  assert main_lib.default_workdir("configs/packed.py", {"data.train": "data/mine"}) == mine


@pytest.mark.slow
def test_a_mixtures_headline_eval_loss_mixes_every_source(tmp_path):
  """Two sources of different lengths and ids; with the default eval_batches the held-out pass
  covers both, `eval_loss` is `sum_s w_s * eval_loss/s` by the 0.7 / 0.3 token shares, and it is
  not the first source's loss (what a pass over the first source's batches alone would give)."""
  from segpack import shards
  for name, base, n in (("a", 16, 300), ("b", 200, 200)):
    lengths = np.random.default_rng(base).integers(5, 60, size=n)
    with shards.ShardWriter(str(tmp_path / name), vocab_size=400, tokenizer_fingerprint="t",
                            shard_tokens=2000,
                            metadata={"tokenizer": {"bos_id": 1, "eos_id": 2, "pad_id": 0}}) as w:
      for d, k in enumerate(lengths):
        w.write((base + (np.arange(k) * (d + 1)) % 150).astype(np.int32))
  spec = f"a={tmp_path / 'a'}:0.7,b={tmp_path / 'b'}:0.3"
  rc, out, err = _run(tmp_path / "run", f"--config.data.train={spec}", "--config.data.source=builtin",
                      "--config.data.eval_share=0.1", "--config.train.num_steps=6",
                      "--config.train.eval_every=3", "--config.train.eval_batches=1",
                      "--config.train.learning_rate=0.01")
  assert rc == 0, err
  evals = [r for r in metrics_lib.read(tmp_path / "run") if r["kind"] == "eval"]
  for r in evals:
    mixed = 0.7 * r["eval_loss/a"] + 0.3 * r["eval_loss/b"]
    assert r["eval_loss"] == pytest.approx(mixed, rel=1e-9)
    # Not the first source's loss: the sources' losses differ well above float noise, and the
    # headline sits 0.3 of the way from a's to b's.
    assert abs(r["eval_loss/b"] - r["eval_loss/a"]) > 1e-4
    assert r["eval_loss"] - r["eval_loss/a"] == pytest.approx(
        0.3 * (r["eval_loss/b"] - r["eval_loss/a"]), rel=1e-6)
    assert r["eval_tokens"] == r["eval_tokens/a"] + r["eval_tokens/b"]
  assert " | a " in out and " | b " in out  # the console line shows each source's loss
  # train.sample reads a mixture run (its datasets name no tokenizer file: ids in and out).
  proc = subprocess.run([sys.executable, "-m", "train.sample", f"--workdir={tmp_path / 'run'}",
                         "--prompt_ids=16,17,18", "--prompt_ids=200,201", "--max_new_tokens=3"],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  answers = [line for line in proc.stdout.splitlines() if " | " in line]
  assert [a.split(" | ")[0] for a in answers] == ["16,17,18", "200,201"]
  assert all(len(a.split(" | ")[1].split(",")) == 3 for a in answers)


_HOLDER = """
import sys, time
from train import run_guard
try:
  with run_guard.workdir_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
except run_guard.WorkdirBusyError as e:
  print("busy", e, flush=True)
"""


@pytest.mark.parametrize("seed", range(2))
def test_property_racing_runs_on_one_workdir_one_holds_the_rest_are_refused(tmp_path, seed):
  """2 to 6 processes (seeded: how many, their start delays, which one is killed) race for one
  workdir's lock: exactly one holds it at a time, every other is refused naming a holder's pid,
  and once the holders are gone (one SIGKILLed) a new run takes the lock at once."""
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 7))
  procs = []
  for _ in range(n):
    time.sleep(float(rng.uniform(0, 0.05)))
    procs.append(subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path), "3"], cwd=REPO,
                                  env=_env(), stdout=subprocess.PIPE, text=True))
  victim = procs[int(rng.integers(0, n))]
  time.sleep(1.5)  # every process has tried the lock by now
  victim.kill()
  outs = [p.communicate(timeout=60)[0] for p in procs]
  held = [p for p, out in zip(procs, outs) if out.startswith("held")]
  busy = [out for out in outs if out.startswith("busy")]
  assert len(held) == 1 and len(busy) + len(held) + (victim not in held and not outs[
      procs.index(victim)]) == n, outs
  for out in busy:
    assert f"pid {held[0].pid}" in out and "is in use by another train.main run" in out
  fresh = subprocess.run([sys.executable, "-c", _HOLDER, str(tmp_path), "0"], cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=60)
  assert fresh.stdout.startswith("held"), fresh.stdout + fresh.stderr

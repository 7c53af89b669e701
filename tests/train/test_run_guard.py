"""One run per workdir, a clean stop on SIGINT / SIGTERM, a finished run left alone, a dataset
changed under a run named as such, a mixture's headline eval loss, and TensorBoard scalars.

Every run here is `python -m train.main` in a subprocess on synthetic documents (no corpus
build), as a user runs it; the oracles are the files the runs leave and their exit codes, and for
a run stopped by signals at random moments then resumed, the uninterrupted run of its config."""

import dataclasses
import json
import os
import pathlib
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from segpack.errors import UserError
from train import checkpoint_digest as digest_lib
from train import metrics as metrics_lib
from train import run_guard
from train import train as train_lib
from train.runs import saved as saved_run
from support import paths
from support import train_configs

REPO = paths.REPO
SYNTHETIC = ["--config=configs/packed.py:smoke", "--config.data.source=synthetic",
             "--config.data.synthetic_docs=300", "--config.data.synthetic_mean_len=30",
             "--config.data.synthetic_vocab=97", "--config.packing.seq_len=64",
             "--config.model.d_model=32", "--config.model.head_dim=8", "--config.model.d_ff=64",
             "--config.train.eval_batches=1", "--config.attention.self_check=False"]


def _env(**more):
  return dict(os.environ, PYTHONPATH=str(REPO),
              XLA_FLAGS=train_configs.one_cpu_device(), **more)


def _start(workdir, *extra, env=None):
  return subprocess.Popen([sys.executable, "-u", "-m", "train.main", *SYNTHETIC,
                           f"--workdir={workdir}", *extra], cwd=REPO, env=env or _env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(workdir, *extra, env=None):
  proc = _start(workdir, *extra, env=env)
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


# A signal at a random moment of a run, then the same command again: the property.
RUN = ("--config.train.num_steps=8", "--config.train.checkpoint_every=2",
       "--config.train.eval_every=3", "--config.train.log_batches=True")
NUM_STEPS = 8
# Where a signal's delay is counted from: the start of the process (imports, data setup), the
# first line of the loop (handlers installed: the initial eval, compilation), the first step.
ANCHORS = {"start": None, "loop": "workdir ", "step 1": "step      1 |"}
INTERRUPTED = "python -m train.main: interrupted; resume from the newest checkpoint with the same command"
TRAIN_KEYS = ("loss", "grad_norm", "lr", "slot_utilization")  # the deterministic ones
EVAL_KEYS = ("eval_loss", "eval_tokens")


class _Child:
  """A `train.main` subprocess whose stdout / stderr lines threads collect with their times."""

  def __init__(self, workdir):
    self.proc = _start(workdir, *RUN)
    self.t0 = time.monotonic()
    self.out, self.err = [], []
    self._readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                     for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
    for reader in self._readers:
      reader.start()

  def _read(self, stream, lines):
    for line in stream:
      lines.append((time.monotonic() - self.t0, line))

  def wait_line(self, text, timeout=300):
    """The time the first stdout line holding `text` came, or None when the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      for t, line in list(self.out):
        if text in line:
          return t
      if self.proc.poll() is not None and not self._readers[0].is_alive():
        return None
      time.sleep(0.002)
    raise AssertionError(f"no line with {text!r} in {self.stdout()[-2000:]}")

  def signal(self, signum):
    if self.proc.poll() is None:
      self.proc.send_signal(signum)

  def finish(self, timeout=300):
    try:
      rc = self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
    for reader in self._readers:
      reader.join(timeout=30)
    return rc, self.stdout(), "".join(line for _, line in self.err)

  def stdout(self):
    return "".join(line for _, line in self.out)


@dataclasses.dataclass(frozen=True)
class Scenario:
  """`signum` sent after `anchor`, `fraction` of the oracle's time from `anchor` to its summary;
  `second`: `(signum, "save starts" | "save renamed")`, a second signal sent as soon as orbax's
  temporary directory of a save appears after the first, or a new step directory (renamed, its
  digest not yet written, perhaps)."""
  signum: int
  anchor: str
  fraction: float
  second: tuple[int, str] | None = None

  @classmethod
  def drawn(cls, seed):
    rng = random.Random(seed)
    sigs = (signal.SIGINT, signal.SIGTERM)
    first, anchor, fraction = rng.choice(sigs), rng.choice(sorted(ANCHORS)), rng.random()
    second = None
    if rng.random() < 0.5:
      second = (rng.choice(sigs), rng.choice(("save starts", "save renamed")))
    return cls(first, anchor, fraction, second)


@dataclasses.dataclass
class RunResult:
  """What a run left that must not depend on interruptions: every batch record of
  `batches.jsonl` (in order), the deterministic fields of every train / eval record, the final
  checkpoint's state (flattened) and data item; `clean`: no process of it ended without saving
  where it stopped (so no step may be logged twice)."""
  batches: list
  train: list
  evals: list
  state: dict
  data: dict
  clean: bool = True


def _result(workdir, clean=True):
  records = metrics_lib.read(workdir)
  checkpoint = saved_run.choose_checkpoint(str(workdir))
  assert checkpoint.step == NUM_STEPS and checkpoint.skipped is None, checkpoint
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                         saved_run.restore_item(checkpoint, "item_metadata")["state"])
  item = saved_run.restore_item(checkpoint, "restore", args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(restore_args=as_numpy), data=ocp.args.JsonRestore()))
  state = {jax.tree_util.keystr(k): np.asarray(v)
           for k, v in jax.tree_util.tree_flatten_with_path(item["state"])[0]}
  with open(pathlib.Path(workdir) / "batches.jsonl", encoding="utf-8") as f:
    batches = [json.loads(line) for line in f]
  return RunResult(batches=batches, data=item["data"], state=state, clean=clean,
                   train=[{k: r[k] for k in ("step",) + TRAIN_KEYS}
                          for r in records if r["kind"] == "train"],
                   evals=[{k: r[k] for k in ("step",) + EVAL_KEYS}
                          for r in records if r["kind"] == "eval"])


def check_same_training(want, got):
  """Raises AssertionError naming the first way `got` (a run interrupted and resumed) differs
  from `want` (the uninterrupted run of the same config): a step dropped, a step logged twice
  with different content (or at all after clean stops), a batch, loss or eval differing from the
  oracle's step, a final array or data position not bit for bit the oracle's."""
  oracle = {r["step"]: r for r in want.batches}
  steps = [r["step"] for r in got.batches]
  dropped, extra = sorted(set(oracle) - set(steps)), sorted(set(steps) - set(oracle))
  assert not dropped and not extra, f"steps dropped: {dropped}, extra: {extra}"
  for record in got.batches:
    assert record == oracle[record["step"]], f"step {record['step']}: not the oracle's batch"
  for a, b in zip(steps, steps[1:]):  # each process goes on one step at a time; a new one may
    assert b == a + 1 or b <= a, f"steps {a} then {b}: data skipped"  # replay from a checkpoint
  if got.clean:
    assert len(steps) == len(set(steps)), f"a step repeated after clean stops: {steps}"
  for kind in ("train", "evals"):
    by_step = {r["step"]: r for r in getattr(want, kind)}
    seen = [r["step"] for r in getattr(got, kind)]
    assert set(seen) == set(by_step), f"{kind} records of steps {sorted(set(seen))}, oracle's " \
                                      f"{sorted(by_step)}"
    for r in getattr(got, kind):
      assert r == by_step[r["step"]], f"step {r['step']}: {r} != oracle's {by_step[r['step']]}"
  assert sorted(got.state) == sorted(want.state), "the final state has other arrays"
  for key, value in want.state.items():
    other = got.state[key]
    assert (other.dtype, other.shape) == (value.dtype, value.shape) and \
        other.tobytes() == value.tobytes(), f"final {key} differs from the oracle's"
  assert got.data == want.data, f"final data position {got.data} != oracle's {want.data}"


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
  """The uninterrupted run: its results, the time from each anchor to its summary line (the end
  of its training, before the process winds down), and its workdir (only read: a test that runs
  in it works on a copy)."""
  workdir = tmp_path_factory.mktemp("oracle") / "run"
  child = _Child(workdir)
  times = {name: 0.0 if text is None else child.wait_line(text) for name, text in ANCHORS.items()}
  end = child.wait_line("summary: ")
  rc, _, err = child.finish()
  assert rc == 0, err[-3000:]
  result = _result(workdir)
  assert [r["step"] for r in result.batches] == list(range(1, NUM_STEPS + 1))
  return result, {name: end - t for name, t in times.items()}, workdir


def _second_signal(child, checkpoints, second):
  """Sends `second[0]` once the trigger `second[1]` is seen in `checkpoints`; False when the
  process ended first."""
  before = set(digest_lib.scan(str(checkpoints)).steps)
  while child.proc.poll() is None:
    listing = digest_lib.scan(str(checkpoints))
    if listing.unfinished if second[1] == "save starts" else set(listing.steps) - before:
      child.signal(second[0])
      return True
    time.sleep(0.0002)
  return False


def _interrupt(workdir, scenario, spans):
  """Starts the run and signals it as `scenario` says; returns (rc, stdout, stderr, the signals
  sent)."""
  child, sent = _Child(workdir), []
  try:
    text = ANCHORS[scenario.anchor]
    if text is None or child.wait_line(text) is not None:
      deadline = time.monotonic() + scenario.fraction * spans[scenario.anchor]
      while child.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
      child.signal(scenario.signum)
      sent.append(scenario.signum)
      if scenario.second is not None and _second_signal(
          child, pathlib.Path(workdir) / "checkpoints", scenario.second):
        sent.append(scenario.second[0])
  finally:
    rc, out, err = child.finish()
  return rc, out, err, sent


def _check_stop(sent, rc, out, err, checkpoints):
  """The documented endings of a run sent the signals `sent`; returns whether it stopped
  cleanly (having saved the step it stopped at, or finished), so that no step is replayed."""
  name = signal.Signals(sent[0]).name
  handled = f"{name} received: saving a checkpoint at the end of this step" in out
  again = signal.SIGINT in sent[1:]  # a second Ctrl-C stops at once, wherever it lands
  own = [line for line in err.splitlines() if line.startswith("python -m train.main: ")]
  stopped = re.fullmatch(rf"python -m train\.main: stopped by {name} at step (\d+); checkpoint saved in "
                         rf"{re.escape(str(checkpoints))}/(\d+); run the same command to resume",
                         own[-1] if own else "")
  if stopped:  # the last line, the exit code 128 + signal, the checkpoint intact
    step = int(stopped[1])
    assert stopped[2] == stopped[1] and handled, err[-3000:]
    assert digest_lib.problem(str(checkpoints / str(step)), step) is None
    if again:  # it came after the stop's line: the exit may be its own
      assert rc in (128 + sent[0], 130, -signal.SIGINT), f"rc {rc}: {err[-3000:]}"
    else:
      assert rc == 128 + sent[0] and err.strip().splitlines()[-1] == own[-1], err[-3000:]
      assert "Traceback" not in err, err[-3000:]
    return True
  if own and own[-1] == INTERRUPTED:  # SIGINT before the handlers, or a second one; what the
    assert rc == 130 and signal.SIGINT in sent, f"rc {rc}: {err[-3000:]}"  # interpreter's
    return False  # teardown prints after it (orbax's event loop cut short) is not ours
  if rc == 0:  # the signal came after the loop, or after the process ended
    assert f"summary: steps={NUM_STEPS}" in out, out[-3000:]
    return True
  if rc == 1 and sent[0] == signal.SIGINT and not handled:  # before the handlers, inside a C
    # extension's import: numpy turns the KeyboardInterrupt into "failed to import"
    assert "KeyboardInterrupt" in err and "failed to import" in err and not own, err[-3000:]
    return False
  if rc == -signal.SIGABRT and sent[0] == signal.SIGINT and not handled:  # before the handlers,
    # inside a nanobind extension's import (jaxlib): C++ cannot carry the KeyboardInterrupt and
    # the interpreter aborts; nothing of the run exists yet
    assert "KeyboardInterrupt" in err and "nanobind::python_error" in err and not own, err[-3000:]
    return False
  assert rc == -sent[0] and not handled, f"rc {rc}: {err[-3000:]}"  # before the handlers
  return False


@pytest.fixture(scope="module")
def resume_env(tmp_path_factory):
  """The reruns share a JAX compilation cache (the signalled runs and the oracle compile): a
  cached program is the program compiled, and the reruns take seconds less."""
  return _env(JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _resume(workdir, env):
  """Runs the same command again (nothing stops it), checking that the signalled run left no
  damaged checkpoint (orbax's temporary directories may stay: the rerun removes them) and where
  the rerun says it starts."""
  checkpoints = pathlib.Path(workdir) / "checkpoints"
  steps = digest_lib.scan(str(checkpoints)).steps  # newest first
  damaged = {s: digest_lib.problem(str(checkpoints / str(s)), s) for s in steps}
  assert not any(damaged.values()), f"damaged checkpoints: {damaged}"
  rc, out, err = _run(workdir, *RUN, env=env)
  assert rc == 0 and "damaged" not in err, err[-3000:]
  if not steps:
    assert "from scratch" in out, out[-2000:]
  elif steps[0] == NUM_STEPS:
    assert f"is finished at step {NUM_STEPS}" in out, out[-2000:]
  else:
    assert f"resuming at step {steps[0]}" in out, out[-2000:]


SEEDS = range(2)  # drawn moments; the pinned ones below are the edges
PINNED = {
    # A signal during the imports or the data setup: no handler yet, no checkpoint; the rerun
    # starts from step 0.
    "SIGINT while importing": Scenario(signal.SIGINT, "start", 0.05),
    "SIGTERM during data setup": Scenario(signal.SIGTERM, "start", 0.45),
    # Ctrl-C, then Ctrl-C again as the stop's checkpoint is renamed into place, before its
    # digest is written: what that save left must not stop the rerun.
    "second SIGINT as the save is renamed": Scenario(signal.SIGINT, "step 1", 0.0,
                                                     (signal.SIGINT, "save renamed")),
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [*map(Scenario.drawn, SEEDS), *PINNED.values()],
                         ids=[*(f"seed{seed}" for seed in SEEDS), *PINNED])
def test_property_a_signal_at_any_moment_then_a_rerun_trains_as_if_never_stopped(
    tmp_path, oracle, resume_env, scenario):
  """SIGINT / SIGTERM at a seeded random moment (imports, data setup, compilation, the initial
  eval, mid-step, between steps, during a save or an eval; sometimes a second signal during the
  stop's save), then the same command again: the run ends as documented (exit code, last line),
  and the rerun's batches, losses, evals and final state are bit for bit the uninterrupted
  run's (`check_same_training`), with no step dropped or repeated."""
  want, spans, _ = oracle
  workdir = tmp_path / "run"
  rc, out, err, sent = _interrupt(workdir, scenario, spans)
  clean = _check_stop(sent, rc, out, err, workdir / "checkpoints")
  _resume(workdir, resume_env)
  check_same_training(want, _result(workdir, clean=clean))


@pytest.mark.slow
def test_the_checker_fails_on_a_dropped_step_another_batch_a_repeat_or_one_ulp(oracle):
  """The negative control: `check_same_training` passes the oracle against itself and fails on
  each deliberate difference."""
  want, _, _ = oracle
  check_same_training(want, want)
  key = next(k for k, v in sorted(want.state.items()) if v.dtype == np.float32 and v.size)
  nudged = want.state[key].copy()
  nudged.flat[0] = np.nextafter(nudged.flat[0], np.float32(np.inf))

  mutants = {
      "a dropped step": dict(batches=want.batches[:3] + want.batches[4:]),
      "another batch": dict(batches=[dict(b, rows=want.batches[0]["rows"]) if b["step"] == 5
                                     else b for b in want.batches]),
      "a step repeated with other content": dict(
          batches=want.batches + [dict(want.batches[2], fingerprint="0" * 16)], clean=False),
      "a step repeated after clean stops": dict(batches=want.batches[:4] + want.batches[3:]),
      "a loss one ulp off": dict(train=[dict(r, loss=float(np.nextafter(r["loss"], np.inf)))
                                        if r["step"] == 7 else r for r in want.train]),
      "an eval loss one ulp off": dict(evals=[dict(r, eval_loss=float(np.nextafter(
          r["eval_loss"], -np.inf))) if r["step"] == 3 else r for r in want.evals]),
      "a parameter one ulp off": dict(state=dict(want.state, **{key: nudged})),
      "another final data position": dict(data=dict(want.data, iterator=dict(
          want.data["iterator"], index=want.data["iterator"]["index"] - 8))),
  }
  for what, change in mutants.items():
    try:
      check_same_training(want, dataclasses.replace(want, **change))
    except AssertionError:
      continue
    pytest.fail(f"check_same_training passes {what}")


@pytest.mark.slow
def test_a_finished_run_started_again_does_nothing(tmp_path, oracle):
  """The oracle's finished run (a copy of its workdir), started again with the same command."""
  workdir = tmp_path / "run"
  shutil.copytree(oracle[2], workdir, symlinks=True)
  before = (workdir / "metrics.jsonl").read_text()
  rc, out, err = _run(workdir, *RUN)
  assert rc == 0, err
  assert f"is finished at step {NUM_STEPS} (train.num_steps={NUM_STEPS}); nothing to do" in out
  assert (workdir / "metrics.jsonl").read_text() == before
  record = json.loads((workdir / run_guard.RECORD_NAME).read_text())
  assert record["config"]["train"]["num_steps"] == NUM_STEPS and record["config"]["data"]["source"]


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
def test_metrics_also_go_to_tensorboard(oracle):
  """The oracle's run (8 steps, evaluations at 0, 3, 6 and 8): every train loss and eval loss of
  metrics.jsonl is a TensorBoard scalar of its step."""
  workdir = oracle[2]
  files = list((workdir / metrics_lib.TENSORBOARD_DIR).glob("events.out.tfevents.*"))
  assert len(files) == 1
  scalars = {}
  for event in _tfrecords(files[0]):
    for value in event.summary.value:
      scalars[(value.tag, event.step)] = value.simple_value
  records = metrics_lib.read(workdir)
  assert {r["kind"] for r in records} >= {"train", "eval"}
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
  # The victim may have taken the lock and been killed before it printed "held" (a loaded
  # machine): the runs refused before the kill then name its pid, and a late starter holds after.
  holders = {held[0].pid} | ({victim.pid} if not outs[procs.index(victim)] else set())
  for out in busy:
    assert any(f"pid {pid} on host" in out for pid in holders), (holders, out)
    assert "is in use by another train.main run" in out
  fresh = subprocess.run([sys.executable, "-c", _HOLDER, str(tmp_path), "0"], cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=60)
  assert fresh.stdout.startswith("held"), fresh.stdout + fresh.stderr


def test_a_start_refused_before_its_first_write_leaves_no_run_directory(tmp_path):
  """A run refused for its data (here a dataset that does not exist) removes the workdir it
  created, lock file and all; a workdir that existed before stays, without a lock file."""
  config = train_configs.synthetic_config(**{"attention.self_check": False})
  with config.unlocked():
    config.data.source = "builtin"
    config.data.train = str(tmp_path / "no-such-dataset")
  fresh, kept = tmp_path / "runs" / "fresh", tmp_path / "kept"
  kept.mkdir()
  for workdir in (fresh, kept):
    with pytest.raises(UserError, match="no-such-dataset"):
      train_lib.train_and_evaluate(config, str(workdir))
  assert not fresh.exists() and (tmp_path / "runs").is_dir()
  assert kept.is_dir() and not any(kept.iterdir())

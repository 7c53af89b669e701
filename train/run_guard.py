"""What keeps a run whole around the training loop: one run per workdir, a clean stop on a signal,
and a record of the config and data the run started with.

Algorithm (`train.train.train_and_evaluate`):
  1. `workdir_lock`: `WORKDIR/.segpack-train.lock` is held (`fcntl`, through `segpack.files`) for
     the whole run; a second run on the same workdir is refused at once, naming the first run's
     pid, host and start time. The lock goes with its process, killed or not.
  2. `check_run_record` / `write_run_record`: `WORKDIR/run.json` holds the resolved config and a
     fingerprint of every dataset the run reads (the SHA-256 of its manifest, which lists every
     shard's SHA-256). A resume whose data differs from the recorded data is refused naming the
     dataset and both fingerprints, before any checkpoint is read.
  3. `StopSignals`: SIGINT (Ctrl-C) and SIGTERM (a preempted job) set a flag; the loop saves a
     checkpoint at the next step boundary and ends with `RunStopped` (exit code 128 + signal). A
     second Ctrl-C stops at once.

Example: Ctrl-C during step 37 of a run that checkpoints every 100 steps saves step 37, prints
"stopped by SIGINT at step 37; checkpoint saved ...; run the same command to resume", exit 130.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from segpack import files
from segpack import remote_files
from segpack.data.mixture import parse_data
from segpack.errors import UserError

LOCK_NAME = ".segpack-train.lock"
RECORD_NAME = "run.json"


class WorkdirBusyError(UserError, OSError):
  """Another run holds the workdir (printed as one line, exit code 2)."""


class DataChangedError(UserError, ValueError):
  """A resumed run's data is not the data it started with (one line, exit code 2)."""


class RunStopped(Exception):
  """A signal stopped the run at a step boundary, after a checkpoint (exit code 128 + signal)."""

  def __init__(self, message: str, *, signum: int):
    super().__init__(message)
    self.signum = signum


@contextlib.contextmanager
def workdir_lock(workdir: str, *, enabled: bool = True, created: bool = False
                 ) -> Iterator[None]:
  """Step 1: holds the workdir's lock for the block (no-op when not `enabled`); the lock file is
  removed when the block ends, and a workdir the run `created` is removed again when the run
  left nothing in it (a start refused before its first write)."""
  if not enabled:
    yield
    return
  try:
    with files.file_lock(Path(workdir) / LOCK_NAME, wait=False, remove=True):
      yield
  except files.LockHeldError as e:
    raise WorkdirBusyError(
        f"--workdir {workdir!r} is in use by another train.main run ({e.owner}; lock file "
        f"{e.path}); wait for it to finish, stop it, or use another --workdir") from None
  finally:
    if created:  # a start that failed before writing anything leaves no empty run directory
      with contextlib.suppress(OSError):
        os.rmdir(workdir)


def _manifest_digest(path: str) -> str | None:
  manifest = Path(path) / "manifest.json"
  return files.sha256_file(manifest) if manifest.is_file() else None


def dataset_paths(train: str | None) -> list[str]:
  """`data.train`'s datasets: the one path, or every source of a mixture."""
  if train is None:
    return []
  try:
    mixture = parse_data(train)
  except ValueError:  # the data module reports it, naming the key
    mixture = None
  paths = [train] if mixture is None else [m.source for m in mixture.sources]
  return [str(p) for p in paths if isinstance(p, str)]


def data_fingerprints(*, train: str | None, eval_path: str | None) -> dict[str, str | None]:
  """Step 2's fingerprints: `{path: sha256 of its manifest.json}` for `data.train` (every source
  of a mixture) and `data.eval`; empty for the built-in and synthetic sources."""
  paths = dataset_paths(train) + ([eval_path] if isinstance(eval_path, str) else [])
  return {p: _manifest_digest(p) for p in paths}


def run_record(workdir: str) -> dict[str, Any]:
  """`WORKDIR/run.json` as written (`config`, `data`, ...); empty when it is absent or unreadable
  (an unreadable record is rewritten; the checkpoint checks still hold)."""
  path = Path(workdir) / RECORD_NAME
  try:
    record = json.loads(path.read_text("utf-8")) if path.is_file() else {}
  except (OSError, ValueError):
    return {}
  return record if isinstance(record, dict) else {}


def check_run_record(workdir: str, fingerprints: dict[str, str | None]) -> None:
  """Step 2 on a resume: refuses data whose fingerprints differ from `WORKDIR/run.json`'s."""
  recorded = run_record(workdir).get("data", {})
  if not isinstance(recorded, dict):
    return
  for name, digest in fingerprints.items():
    before = recorded.get(name, digest)
    if before != digest:
      raise DataChangedError(
          f"the dataset {name!r} differs from the one this run started with (manifest sha256 "
          f"{str(before)[:16]}... then, {str(digest)[:16]}... now: it was replaced or "
          f"retokenized); restore it, or train on it in a new --workdir")


def write_run_record(workdir: str, *, config: dict[str, Any],
                     fingerprints: dict[str, str | None]) -> str:
  """Step 2: writes `WORKDIR/run.json` (resolved config, data fingerprints) atomically."""
  path = Path(workdir) / RECORD_NAME
  started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  files.atomic_write_json(path, {"config": config, "data": fingerprints, "written": started,
                                 "config_sha256": hashlib.sha256(json.dumps(
                                     config, sort_keys=True).encode()).hexdigest()})
  return str(path)


def keep_run_record(workdir: str, config: dict[str, Any], fingerprints: dict[str, str | None],
                    *, fresh: bool) -> None:
  """Writes `WORKDIR/run.json` for a run from scratch, or for a resume that has none."""
  if fresh or not (Path(workdir) / RECORD_NAME).is_file():
    write_run_record(workdir, config=config, fingerprints=fingerprints)


# Config keys that hold a local path given relative to where the command ran (made absolute
# once, by `absolute_paths`); `data.train` may also be a mixture of such paths.
PATH_KEYS = ("data.train", "data.eval", "data.cache_dir", "model.init_from",
             "model.init_adapter", "preference.reference")
KEYWORDS = ("init",)  # values of PATH_KEYS that are not paths (preference.reference="init")
KEPT_DIR = "datasets"  # WORKDIR/datasets/<k>: data.train's k-th dataset, all but its shards


def _absolute(path: str) -> str:
  return path if remote_files.is_url(path) else os.path.abspath(os.path.expanduser(path))


def absolute_value(key: str, value: Any) -> Any:
  """`value` of a `PATH_KEYS` key with its local paths absolute (a mixture's, each source's,
  written back as `name=PATH:weight`); anything else (None, URLs, an unreadable mixture, which
  the data module names) as it is."""
  if key not in PATH_KEYS or not isinstance(value, str) or not value or value in KEYWORDS:
    return value
  if key != "data.train":
    return _absolute(value)
  try:
    mixture = parse_data(value)
  except ValueError:
    return value
  if mixture is None:
    return _absolute(value)
  return ",".join(f"{m.name}={_absolute(str(m.source))}:{m.weight!r}" for m in mixture.sources)


def absolute_paths(config: Any) -> None:
  """Makes every `PATH_KEYS` value of `config` absolute, against the current directory: a run
  records where its data and base model are, wherever it is resumed, sampled or exported from."""
  for key in PATH_KEYS:
    group, name = key.split(".")
    if group in config and name in config[group]:
      config[group][name] = absolute_value(key, config[group][name])


def training_dirs(train: str | None) -> list[str]:
  """The local directories of `data.train` (each source of a mixture; URLs left out)."""
  return [p for p in dict.fromkeys(dataset_paths(train)) if not remote_files.is_url(p)]


def keep_datasets(workdir: str, dataset_dirs: list[str]) -> None:
  """Copies into `WORKDIR/datasets/<k>/` every file of the k-th local training dataset but its
  shards (its manifest, the tokenizer copy it names, a chat template), replacing an earlier
  copy: sample and export read the run's tokenizer and chat template there when the dataset has
  moved (`train.runs.saved.run_config`). Each copy is staged and renamed into place."""
  root = Path(workdir) / KEPT_DIR
  root.mkdir(exist_ok=True)
  for k, directory in enumerate(dataset_dirs):
    source = Path(directory)
    if not (source / "manifest.json").is_file():
      continue
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{k}-"))
    for entry in source.iterdir():
      if entry.is_file() and not (entry.name.startswith("shard-") or entry.name.endswith(".tmp")):
        shutil.copyfile(entry, staging / entry.name)
    old = root / f".{k}-old"
    shutil.rmtree(old, ignore_errors=True)
    if (root / str(k)).exists():
      os.replace(root / str(k), old)
    os.replace(staging, root / str(k))
    shutil.rmtree(old, ignore_errors=True)


class StopSignals:
  """Step 3: SIGINT / SIGTERM handlers for the loop (a no-op off the main thread).

  `requested` is the first signal's number (None until one arrives). A second SIGINT raises
  `KeyboardInterrupt` at once; the previous handlers come back when the block ends.
  """

  def __init__(self):
    self.requested: int | None = None
    self._previous: dict[int, Any] = {}

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if self.requested is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    if self.requested is None:
      self.requested = signum
      print(f"train.main: {signal.Signals(signum).name} received: saving a checkpoint at the "
            f"end of this step (Ctrl-C again to stop at once)", flush=True)

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGINT, signal.SIGTERM):
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc: Any) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def stopped(self, *, step: int, checkpoint_dir: str) -> RunStopped:
    """The exception that ends the run after the checkpoint of `step` was saved."""
    name = signal.Signals(self.requested).name
    return RunStopped(f"stopped by {name} at step {step}; checkpoint saved in "
                      f"{checkpoint_dir}/{step}; run the same command to resume",
                      signum=int(self.requested))


class NonFiniteError(UserError, ArithmeticError):
  """A step's loss, gradient norm or update is not finite; the run stops without saving it."""


def check_finite(first_step: int, window: list[dict[str, Any]], *,
                 checkpointer: Any, learning_rate: float) -> None:
  """Raises `NonFiniteError` at the first step of `window` (fetched metrics of the steps
  `first_step, first_step + 1, ...`, or eval records) with a non-finite value or `finite` flag."""
  for step, m in enumerate(window, start=first_step):
    bad = [f"the {k.replace('_', ' ')} is {float(m[k])}" for k in ("loss", "grad_norm", "eval_loss")
           if k in m and not np.isfinite(float(m[k]))]
    if not bad and bool(m.get("finite", True)):
      continue
    what = bad[0] if bad else "the new parameters or optimizer state are not finite"
    kept = checkpointer.latest_step()
    kept = "there is no checkpoint" if kept is None else f"the checkpoint of step {kept} is kept"
    raise NonFiniteError(
        f"step {step}: {what}; stopped without saving it, {kept} (try a train.learning_rate "
        f"lower than {learning_rate:g}, a longer train.warmup_steps or train.grad_clip > 0)")


class WorkdirError(UserError, OSError):
  """The workdir cannot be created or written."""


def check_workdir(workdir: str | os.PathLike) -> str:
  """Creates `workdir` if needed and proves it writable with an atomic probe file."""
  path = os.path.abspath(os.fspath(workdir))
  try:
    os.makedirs(path, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
    os.close(fd)
    os.replace(probe, probe + ".done")
    os.remove(probe + ".done")
  except OSError as e:
    raise WorkdirError(f"--workdir {path!r} is not writable: {e}") from e
  return path

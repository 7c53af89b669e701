"""Faults of the checkpoints directory: a full or read-only disk, and entries that are no step.

A disk (`train.checkpoint`, `train.checkpoint_digest`):
- a directory that cannot be written stops the run when the `Checkpointer` is made, before the
  first step, in one `CheckpointWriteError` line naming it (a read-only mount, a directory
  without permission);
- a save on a full disk ends the run with one line naming the directory and its free space; the
  temporary step directory is removed and the newest verified checkpoint stays the one a rerun
  resumes from, exactly.

The full disk is a real one where this machine lets the test mount a small tmpfs (as root; the
test is skipped otherwise), and, everywhere, orbax's save replaced by one that leaves a
temporary step directory and raises the error orbax raises on a full disk (read from orbax's
source and seen on a full tmpfs: tensorstore's `ValueError: RESOURCE_EXHAUSTED: ... No space left
on device [os_error_code='28']` from the array writes, `OSError(ENOSPC)` from its JSON writes).

Entries: whatever `checkpoints/` holds besides well-formed steps (a step directory that is a
link to itself, `06` next to `6`, a file named like a step, orbax's temporary directories, a
digest that is a FIFO or a directory, `damaged_checkpoints` that is a file, ...), the trainer
and `train.sample` choose the same newest intact step, and the trainer saves the next steps; a
property test draws random sets of such entries around one intact step.
"""

import errno
import itertools
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.checkpoints import copy_checkpoints, restore, trained  # noqa: F401 (a fixture)

from support.paths import REPO
from train import checkpoint as ckpt_lib
from train import checkpoint_digest as digest_lib
from train.runs import saved as saved_run
from train.runs import loaded as loaded_run
from train import train as train_lib
from segpack.errors import UserError

# What orbax 0.12 raised on a full tmpfs (its tensorstore array writes), path shortened.
ORBAX_FULL = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file '
    '"/w/checkpoints/6.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed '
    'writing: "/w/checkpoints/6.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/'
    'd/5ca7": Failed to write 477433 bytes to file 7: No space left on device '
    "[os_error_code='28']")
SIZE = r"[0-9.]+ (B|KiB|MiB|GiB|TiB)"


def _failing_save(error):
  """An orbax `CheckpointManager.save` that writes part of a temporary step directory, then
  raises `error`, as orbax does when the disk fills up during a save."""

  def save(self, step, *args, **kwargs):
    partial = os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp",
                           "state.orbax-checkpoint-tmp")
    os.makedirs(partial)
    with open(os.path.join(partial, "d"), "wb") as f:
      f.write(b"\0" * 1000)
    raise error

  return save


@pytest.fixture
def mount(tmp_path):
  """`mount(name, size, read_only=False)`: a tmpfs at `tmp_path/name` (the test is skipped where
  mounting is not permitted); unmounted after the test."""
  mounted = []

  def mount_tmpfs(name, size, read_only=False):
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    try:
      proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, text=True, timeout=60)
    except OSError as e:
      pytest.skip(f"cannot mount a tmpfs here: {e}")
    if proc.returncode:
      pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    mounted.append(path)
    if read_only:
      subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, timeout=60)
    return path

  yield mount_tmpfs
  for path in reversed(mounted):
    subprocess.run(["umount", "-l", str(path)], check=False, timeout=60)


def _fill(disk, leave):
  """Fills the file system of `disk` with a file `disk/filler`, leaving `leave` bytes free."""
  free = shutil.disk_usage(disk).free
  with open(disk / "filler", "wb") as f:
    f.write(b"\0" * max(free - leave, 0))


def _entries(directory):
  return sorted(os.listdir(directory))


# A full disk.

@pytest.mark.parametrize("error", [ORBAX_FULL, OSError(errno.ENOSPC, "No space left on device")],
                         ids=["array_write", "json_write"])
def test_a_save_on_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(trained, tmp_path,
                                                                        monkeypatch, error):
  workdir = copy_checkpoints(trained["workdir"], tmp_path)
  directory = workdir / "checkpoints"
  state, data_state = trained["intact"][4]
  checkpointer = ckpt_lib.Checkpointer(directory, every=2, max_to_keep=3)
  assert checkpointer.restore_or_none(trained["abstract"], trained["config_dict"]).step == 4
  monkeypatch.setattr(ocp.CheckpointManager, "save", _failing_save(error))
  with pytest.raises(UserError) as e:
    checkpointer.maybe_save(6, state, data_state, trained["config_dict"])
  message = str(e.value)
  assert isinstance(e.value, ckpt_lib.CheckpointWriteError) and "\n" not in message
  assert message.startswith(f"cannot save the checkpoint {directory}/6: No space left on device ("
                            ), message
  assert " free of " in message and "a checkpoint of this run takes " in message, message
  assert f"the newest intact checkpoint, {directory}/4, is kept" in message, message
  assert _entries(directory) == ["2", "4"]  # the temporary step directory is removed
  monkeypatch.undo()
  restored, warnings = restore(workdir, trained["abstract"], trained["config_dict"])
  assert restored.step == 4 and not warnings


def test_a_save_that_fails_for_another_reason_keeps_its_traceback(trained, tmp_path,
                                                                  monkeypatch):
  """Only a failure of the disk is one line: any other error of orbax's save is a bug."""
  monkeypatch.setattr(ocp.CheckpointManager, "save", _failing_save(ValueError("a bug")))
  checkpointer = ckpt_lib.Checkpointer(tmp_path / "checkpoints", every=2, max_to_keep=3)
  state, data_state = trained["intact"][4]
  with pytest.raises(ValueError, match="^a bug$"):
    checkpointer.maybe_save(2, state, data_state, trained["config_dict"])


def _interrupted_digest(step_dir, step):
  raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["orbax_save", "digest"])
def test_a_second_ctrl_c_during_a_save_leaves_the_last_checkpoint_the_newest(trained, tmp_path,
                                                                           monkeypatch, where):
  """A KeyboardInterrupt (`run_guard.StopSignals`' second Ctrl-C) in orbax's save, or after it
  renamed the step into place but before its digest is written, removes what the save left and
  goes on: the rerun resumes from the checkpoint before, with no warning (a step without its
  digest would be damaged, and the only one would stop the rerun)."""
  workdir = copy_checkpoints(trained["workdir"], tmp_path)
  directory = workdir / "checkpoints"
  state, data_state = trained["intact"][4]
  checkpointer = ckpt_lib.Checkpointer(directory, every=2, max_to_keep=3)
  assert checkpointer.restore_or_none(trained["abstract"], trained["config_dict"]).step == 4
  if where == "orbax_save":
    monkeypatch.setattr(ocp.CheckpointManager, "save", _failing_save(KeyboardInterrupt()))
  else:
    monkeypatch.setattr(digest_lib, "write", _interrupted_digest)
  with pytest.raises(KeyboardInterrupt):
    checkpointer.maybe_save(6, state, data_state, trained["config_dict"])
  assert _entries(directory) == ["2", "4"]
  monkeypatch.undo()
  restored, warnings = restore(workdir, trained["abstract"], trained["config_dict"])
  assert restored.step == 4 and not warnings


def test_too_little_free_space_for_the_next_save_is_one_line_and_writes_nothing(
    trained, tmp_path, monkeypatch):
  """Less free space than the newest verified checkpoint takes: refused before orbax writes."""
  workdir = copy_checkpoints(trained["workdir"], tmp_path)
  directory = workdir / "checkpoints"
  state, data_state = trained["intact"][4]
  checkpointer = ckpt_lib.Checkpointer(directory, every=2, max_to_keep=3)
  assert checkpointer.restore_or_none(trained["abstract"], trained["config_dict"]).step == 4
  monkeypatch.setattr(shutil, "disk_usage",
                      lambda path: shutil._ntuple_diskusage(8 << 20, (8 << 20) - 4096, 4096))
  monkeypatch.setattr(ocp.CheckpointManager, "save", _failing_save(AssertionError("saved")))
  with pytest.raises(ckpt_lib.CheckpointWriteError,
                     match=f"^cannot save the checkpoint {directory}/6: not enough space \\(4.0 "
                           f"KiB free of 8.0 MiB; a checkpoint of this run takes {SIZE}\\); the "
                           f"newest intact checkpoint, {directory}/4, is kept: free some space"):
    checkpointer.maybe_save(6, state, data_state, trained["config_dict"])
  assert _entries(directory) == ["2", "4"]


def test_write_errno_reads_os_errors_and_orbax_messages():
  assert digest_lib.write_errno(OSError(errno.ENOSPC, "full")) == errno.ENOSPC
  assert digest_lib.write_errno(ORBAX_FULL) == errno.ENOSPC
  try:
    try:
      raise OSError(errno.EROFS, "Read-only file system")
    except OSError as inner:
      raise RuntimeError("wrapped") from inner
  except RuntimeError as outer:
    assert digest_lib.write_errno(outer) == errno.EROFS
  assert digest_lib.write_errno(ValueError("Requested shape (3,) is not compatible")) is None
  assert digest_lib.write_errno(FileNotFoundError(errno.ENOENT, "gone")) is None
  assert digest_lib.write_errno(None) is None


# After the failed writes, tensorstore's callbacks meet orbax's closed event loop (ignored).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_real_full_disk_at_the_first_save(trained, mount):
  """Orbax itself meets the full disk (no earlier checkpoint to measure a save by)."""
  disk = mount("disk", "4m")
  directory = disk / "checkpoints"
  checkpointer = ckpt_lib.Checkpointer(directory, every=2, max_to_keep=3)
  _fill(disk, leave=64 << 10)
  state, data_state = trained["intact"][2]
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    checkpointer.maybe_save(2, state, data_state, trained["config_dict"])
  message = str(e.value)
  assert message.startswith(f"cannot save the checkpoint {directory}/2: No space left on device "
                            "("), message
  assert "free of 4.0 MiB" in message and "there is no earlier checkpoint" in message, message
  assert _entries(directory) == []  # orbax's temporary directory is removed
  os.remove(disk / "filler")
  checkpointer = ckpt_lib.Checkpointer(directory, every=2, max_to_keep=3)
  assert checkpointer.maybe_save(2, state, data_state, trained["config_dict"])
  checkpointer.close()
  restored, warnings = restore(disk, trained["abstract"], trained["config_dict"])
  assert restored.step == 2 and not warnings and restored.data_state == data_state


def test_a_real_full_disk_mid_run_stops_and_the_rerun_resumes_exactly(trained, mount,
                                                                       monkeypatch):
  """The disk fills up after the checkpoint of step 2: the save of step 4 is refused in one line;
  once space is freed, the rerun resumes from 2 and ends with the state and data position of an
  uninterrupted run."""
  disk = mount("disk", "16m")
  write = digest_lib.write

  def write_then_fill(step_dir, step):
    path = write(step_dir, step)
    if step == 2:
      _fill(disk, leave=64 << 10)
    return path

  monkeypatch.setattr(digest_lib, "write", write_then_fill)
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    train_lib.train_and_evaluate(trained["config"], str(disk))
  assert str(e.value).startswith(f"cannot save the checkpoint {disk}/checkpoints/4: not enough "
                                 "space ("), str(e.value)
  assert _entries(disk / "checkpoints") == ["2"]
  os.remove(disk / "filler")
  monkeypatch.setattr(digest_lib, "write", write)
  assert train_lib.train_and_evaluate(trained["config"], str(disk))["resumed_from"] == 2
  restored, warnings = restore(disk, trained["abstract"], trained["config_dict"])
  assert restored.step == 4 and not warnings
  state, data_state = trained["intact"][4]
  assert restored.data_state == data_state
  for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7)


def _cli(workdir, *flags):
  return subprocess.run(
      [sys.executable, "-m", "train.main", "--config=configs/packed.py:smoke",
       "--config.data.source=synthetic", "--config.data.synthetic_docs=300",
       "--config.attention.self_check=False", "--config.train.eval_every=0",
       f"--workdir={workdir}", *flags], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_full_disk_exits_2_with_one_line_naming_the_free_space(mount):
  disk = mount("disk", "16m")
  assert _cli(disk, "--config.train.num_steps=2").returncode == 0
  _fill(disk, leave=64 << 10)
  proc = _cli(disk, "--config.train.num_steps=4")
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith(f"python -m train.main: error: cannot save the checkpoint {disk}/checkpoints/4: not "
                             "enough space ("), lines
  assert "free of 16.0 MiB; a checkpoint of this run takes" in lines[0], lines
  assert _entries(disk / "checkpoints") == ["2"]


# A directory that cannot be written: refused before the first step.

def _read_only_mount(workdir, mount, monkeypatch):
  mount("workdir/checkpoints", "1m", read_only=True)
  return "Read-only file system"


def _no_write_permission(workdir, mount, monkeypatch):
  if os.geteuid() == 0:
    pytest.skip("root writes into a chmod 555 directory: see the other cases")
  os.chmod(workdir / "checkpoints", 0o555)  # made writable again by the test
  return "Permission denied"


def _simulated_permission_denied(workdir, mount, monkeypatch):
  """Works for root too: creating a file under `checkpoints/` raises EACCES (`tempfile.mkstemp`
  is replaced there; elsewhere it is the real one)."""
  real = tempfile.mkstemp
  directory = str(workdir / "checkpoints")

  def mkstemp(*args, dir=None, **kwargs):  # pylint: disable=redefined-builtin
    if dir is not None and os.path.abspath(dir).startswith(directory):
      raise PermissionError(errno.EACCES, "Permission denied", dir)
    return real(*args, dir=dir, **kwargs)

  monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
  return "Permission denied"


UNWRITABLE = {"read_only_mount": _read_only_mount, "chmod_555": _no_write_permission,
              "simulated_permission_denied": _simulated_permission_denied}


@pytest.mark.parametrize("case", sorted(UNWRITABLE))
def test_an_unwritable_checkpoints_directory_is_refused_before_the_first_step(
    trained, tmp_path, mount, monkeypatch, case):
  workdir = tmp_path / "workdir"
  (workdir / "checkpoints").mkdir(parents=True)
  why = UNWRITABLE[case](workdir, mount, monkeypatch)
  try:
    with pytest.raises(UserError) as e:
      train_lib.train_and_evaluate(trained["config"], str(workdir))
  finally:
    if case == "chmod_555":
      os.chmod(workdir / "checkpoints", 0o755)
  message = str(e.value)
  assert isinstance(e.value, ckpt_lib.CheckpointWriteError) and "\n" not in message
  assert message.startswith(f"{workdir / 'checkpoints'} is not writable ({why}; "), message
  assert " free of " in message, message
  assert not (workdir / "metrics.jsonl").exists()  # no step was taken


# Entries that are no well-formed step.

def _damaged_copy(cp, name):
  """A copy of step 4 named `name`: its digest names step 4, so as a step it is damaged."""
  shutil.copytree(cp / "4", cp / name)


def _with_digest_for(cp, source, target_dir, step):
  shutil.copytree(cp / source, target_dir)
  digest_lib.write(str(target_dir), step)


def _self_link(workdir):
  os.symlink(workdir / "checkpoints" / "8", workdir / "checkpoints" / "8")


def _zero_padded(workdir):
  cp = workdir / "checkpoints"
  _damaged_copy(cp, "6")
  _damaged_copy(cp, "06")


def _damaged_checkpoints_is_a_file(workdir):
  (workdir / "damaged_checkpoints").write_text("not a directory")
  os.mkdir(workdir / "checkpoints" / "6")  # damaged (empty), so it must be moved aside


def _step_is_a_file(workdir):
  (workdir / "checkpoints" / "6").write_text("not a checkpoint")
  return lambda: (workdir / "damaged_checkpoints" / "6").read_text() == "not a checkpoint"


def _orbax_temporary(workdir):
  cp = workdir / "checkpoints"
  shutil.copytree(cp / "4", cp / "7.orbax-checkpoint-tmp-1732540000")
  os.mkdir(cp / "8.orbax-checkpoint-tmp")
  return lambda: not any(".orbax-checkpoint-tmp" in n for n in os.listdir(cp))  # removed


def _digest_is_a_fifo(workdir):
  cp = workdir / "checkpoints"
  _damaged_copy(cp, "6")
  os.remove(cp / "6" / digest_lib.DIGEST_FILE)
  os.mkfifo(cp / "6" / digest_lib.DIGEST_FILE)  # reading it would wait for a writer forever


def _digest_is_a_directory(workdir):
  cp = workdir / "checkpoints"
  _damaged_copy(cp, "6")
  os.remove(cp / "6" / digest_lib.DIGEST_FILE)
  os.mkdir(cp / "6" / digest_lib.DIGEST_FILE)


def _unicode_digits(workdir):
  os.mkdir(workdir / "checkpoints" / "\u0661\u0662")  # Arabic-Indic "12": str.isdigit() is True


def _beyond_int32(workdir):
  cp = workdir / "checkpoints"
  _with_digest_for(cp, "4", cp / str(2**40), 2**40)  # intact by its digest, but no int32 step


def _linked_elsewhere(workdir):
  """`8` links to a checkpoint outside `checkpoints/` that matches a digest of step 8."""
  _with_digest_for(workdir / "checkpoints", "4", workdir / "elsewhere", 8)
  os.symlink(workdir / "elsewhere", workdir / "checkpoints" / "8")


def _dangling_link(workdir):
  os.symlink(workdir / "nowhere", workdir / "checkpoints" / "6")


def _older_step_linked_elsewhere(workdir):
  """`1`, older than the intact steps, links to a directory outside: rotation must not delete
  through it (nor stop on it)."""
  _with_digest_for(workdir / "checkpoints", "2", workdir / "elsewhere", 1)
  os.symlink(workdir / "elsewhere", workdir / "checkpoints" / "1")


ODD = {"step_symlinked_to_itself": _self_link, "06_next_to_6": _zero_padded,
       "damaged_checkpoints_is_a_file": _damaged_checkpoints_is_a_file,
       "step_is_a_file": _step_is_a_file, "orbax_temporary_directories": _orbax_temporary,
       "digest_is_a_fifo": _digest_is_a_fifo, "digest_is_a_directory": _digest_is_a_directory,
       "unicode_digits": _unicode_digits, "step_beyond_int32": _beyond_int32,
       "step_linked_elsewhere": _linked_elsewhere, "dangling_link": _dangling_link,
       "older_step_linked_elsewhere": _older_step_linked_elsewhere}


@pytest.mark.parametrize("case", sorted(ODD))
def test_odd_entries_do_not_stop_the_run_or_its_reruns(trained, tmp_path, case):
  """Steps 2 and 4 intact, plus the odd entries: the trainer and `train.sample` choose 4, the
  trainer saves 6 and 8 (names some entries took), and a rerun chooses 8."""
  workdir = copy_checkpoints(trained["workdir"], tmp_path)
  check = ODD[case](workdir)  # None, or what must hold after the rerun
  assert loaded_run.load_run(str(workdir))[2] == 4  # reads its parameters among the entries
  restored, warnings = restore(workdir, trained["abstract"], trained["config_dict"])
  assert restored.step == 4, warnings
  state, data_state = trained["intact"][4]
  checkpointer = ckpt_lib.Checkpointer(workdir / "checkpoints", every=2, max_to_keep=3)
  try:
    checkpointer.restore_or_none(trained["abstract"], trained["config_dict"])
    for step in (6, 8):
      assert checkpointer.maybe_save(step, state, data_state, trained["config_dict"])
  finally:
    checkpointer.close()
  restored, warnings = restore(workdir, trained["abstract"], trained["config_dict"])
  assert restored.step == 8 and all(": skipped " in w for w in warnings), warnings
  assert saved_run.choose_checkpoint(str(workdir)).step == 8
  if (workdir / "elsewhere").exists():  # what a link pointed to is never deleted
    assert (workdir / "elsewhere" / digest_lib.DIGEST_FILE).exists()
  assert check is None or check()


def test_odd_entries_are_named_in_warnings(trained, tmp_path):
  workdir = copy_checkpoints(trained["workdir"], tmp_path)
  cp = workdir / "checkpoints"
  _zero_padded(workdir)
  _orbax_temporary(workdir)
  (workdir / "damaged_checkpoints").write_text("not a directory")
  restored, warnings = restore(workdir, trained["abstract"], trained["config_dict"])
  assert restored.step == 4
  text = " | ".join(warnings)
  assert f"{cp}: skipped '06': not a checkpoint" in text, text
  assert (f"{cp}: removed 7.orbax-checkpoint-tmp-1732540000, 8.orbax-checkpoint-tmp, orbax's "
          "temporary directories of saves that did not finish") in text, text
  assert f"checkpoint {cp}/6 is damaged: {cp / '6' / digest_lib.DIGEST_FILE} is not a " in text
  assert f"moved to {workdir / 'damaged_checkpoints-1' / '6'}" in text, text
  assert _entries(cp) == ["06", "2", "4"]
  assert (workdir / "damaged_checkpoints").read_text() == "not a directory"


def test_scan_sorts_entries_by_name():
  with tempfile.TemporaryDirectory() as d:
    for name in ("0", "2", "10", "04", "-3", "step_9", "\u0661", "7.orbax-checkpoint-tmp",
                 "7.orbax-checkpoint-tmp-12", "7.orbax-checkpoint-tmp-x", ".write-check-1"):
      os.mkdir(os.path.join(d, name))
    listing = digest_lib.scan(d)
  assert listing.steps == [10, 2, 0]
  assert listing.unfinished == ["7.orbax-checkpoint-tmp", "7.orbax-checkpoint-tmp-12"]
  assert listing.other == sorted(["04", "-3", "step_9", "\u0661", "7.orbax-checkpoint-tmp-x"])
  assert digest_lib.scan(os.path.join(d, "gone")).steps == []


def test_an_unlistable_step_directory_is_damaged_not_a_traceback(tmp_path, monkeypatch):
  """Its listing refused (EACCES, simulated: root lists anything): a problem line."""
  step_dir = tmp_path / "6"
  step_dir.mkdir()
  (step_dir / "state").write_text("")
  real = os.listdir

  def listdir(path="."):
    if os.fspath(path) == str(step_dir):
      raise PermissionError(errno.EACCES, "Permission denied", str(step_dir))
    return real(path)

  monkeypatch.setattr(os, "listdir", listdir)
  assert digest_lib.problem(str(step_dir), 6).startswith("cannot list it (")


# The property: random odd entries around one intact step.

KINDS = ("self_link", "dangling_link", "link_to_intact", "link_elsewhere", "zero_padded", "file",
         "unfinished", "empty_dir", "no_digest", "other_steps_digest", "digest_dir",
         "digest_fifo", "unicode_digits", "other_name")
ENTRY = st.tuples(st.sampled_from(KINDS), st.integers(0, 40))
NAME = st.text(alphabet="abc_-.0123456789", min_size=1, max_size=8)


def _make(cp, kind, step, name):
  """Makes one odd entry of `kind` in `cp` (around the intact step 2); False when its name is
  taken."""
  names = {"zero_padded": "0" + str(step), "unicode_digits": chr(0x660 + step % 10) * 2,
           "other_name": name, "unfinished": f"{step}.orbax-checkpoint-tmp-{step * 7}"}
  path = cp / names.get(kind, str(step))
  if os.path.lexists(path):
    return False
  if kind == "self_link":
    os.symlink(path, path)
  elif kind == "dangling_link":
    os.symlink(cp / "nowhere", path)
  elif kind == "link_to_intact":
    os.symlink("2", path)
  elif kind == "link_elsewhere":
    _with_digest_for(cp, "2", cp.parent / f"elsewhere{step}", step)
    os.symlink(cp.parent / f"elsewhere{step}", path)
  elif kind == "file":
    path.write_bytes(b"")
  elif kind in ("empty_dir", "unicode_digits", "other_name"):
    path.mkdir()
  else:
    shutil.copytree(cp / "2", path)
    if kind in ("no_digest", "digest_dir", "digest_fifo"):
      os.remove(path / digest_lib.DIGEST_FILE)
    if kind == "digest_dir":
      os.mkdir(path / digest_lib.DIGEST_FILE)
    elif kind == "digest_fifo":
      os.mkfifo(path / digest_lib.DIGEST_FILE)
  return True


EXAMPLES = itertools.count()


@settings(max_examples=25, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(entries=st.lists(ENTRY, min_size=1, max_size=6), name=NAME,
       damaged_root_is_a_file=st.booleans())
def test_property_random_odd_entries_around_one_intact_step(trained, tmp_path, entries, name,
                                                            damaged_root_is_a_file):
  """Only step 2 is intact; whatever else `checkpoints/` holds (older or newer), the trainer and
  `train.sample` choose 2, nothing raises, and the trainer then saves the newest step an entry
  was named by and the one after it, rotating all else out (one checkpoint kept)."""
  workdir = tmp_path / f"case{next(EXAMPLES)}"
  copy_checkpoints(trained["workdir"], workdir)
  cp = workdir / "checkpoints"
  shutil.rmtree(cp / "4")
  made = [(kind, step) for kind, step in entries if step != 2 and _make(cp, kind, step, name)]
  if damaged_root_is_a_file:
    (workdir / "damaged_checkpoints").write_text("")
  assert saved_run.choose_checkpoint(str(workdir)).step == 2
  checkpointer = ckpt_lib.Checkpointer(cp, every=1, max_to_keep=1)
  state, data_state = trained["intact"][2]
  nxt = max([3] + [step for kind, step in made if kind not in ("zero_padded", "other_name",
                                                               "unicode_digits")])
  try:
    assert checkpointer.restore_or_none(trained["abstract"], trained["config_dict"]).step == 2
    for step in (nxt, nxt + 1):
      assert checkpointer.maybe_save(step, state, data_state, trained["config_dict"])
  finally:
    checkpointer.close()
  assert saved_run.choose_checkpoint(str(workdir)).step == nxt + 1
  restored, _ = restore(workdir, trained["abstract"], trained["config_dict"])
  assert restored.step == nxt + 1 and restored.data_state == data_state
  for kind, step in made:  # what a link pointed to is never deleted
    if kind == "link_elsewhere":
      assert (workdir / f"elsewhere{step}" / digest_lib.DIGEST_FILE).exists()
  shutil.rmtree(workdir)

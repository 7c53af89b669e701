"""Checkpoints carry a sha256 digest of their files: a damaged one is named in a warning and the
newest intact one before it is restored, or, when none is intact, the run stops with one line
naming the checkpoints (exit code 2 from `train.main`), never a silent fresh start. Rotation
never removes the newest verified checkpoint."""

import logging
import os
import random
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from support.train_configs import synthetic_config
from train import checkpoint as ckpt_lib
from train import checkpoint_digest as digest_lib
from train import train as train_lib
from train import setup as setup_lib
from segpack.errors import UserError
from support.checkpoints import BASE, copy_checkpoints, own_warnings, restore, trained  # noqa: F401 (a fixture)
from support import paths

REPO = str(paths.REPO)


def _largest_data_file(step_dir):
  files = [os.path.join(r, n) for r, _, names in os.walk(step_dir / "state" / "ocdbt.process_0")
           for n in names if os.sep + "d" + os.sep in os.path.join(r, n)]
  return max(files, key=os.path.getsize)


def _truncate(step_dir):
  path = _largest_data_file(step_dir)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  return path


def _bad_json(step_dir):
  path = str(step_dir / "meta" / "metadata")
  with open(path, "w") as f:
    f.write('{"config": {')
  return path


def _delete_state(step_dir):
  shutil.rmtree(step_dir / "state")
  return str(step_dir / "state")


DAMAGE = {"truncated_data_file": _truncate, "bad_metadata_json": _bad_json,
          "deleted_state_directory": _delete_state}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_falls_back_to_the_older_checkpoint_saying_so(trained, tmp_path, damage):
  workdir = copy_checkpoints(trained["workdir"], tmp_path)
  path = DAMAGE[damage](workdir / "checkpoints" / "4")
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logging.getLogger("absl").addHandler(handler)
  try:
    run = setup_lib.setup(trained["config"], str(workdir))
  finally:
    logging.getLogger("absl").removeHandler(handler)
  run.checkpointer.close()
  assert run.start_step == 2
  warnings = " | ".join(own_warnings(records))
  assert f"checkpoint {workdir / 'checkpoints'}/4 is damaged: {path}" in warnings, warnings
  assert f"newest intact checkpoint {workdir / 'checkpoints'}/2 instead" in warnings, warnings
  assert not (workdir / "checkpoints" / "4").exists()  # moved aside, named in the warning
  assert os.path.isdir(workdir / "damaged_checkpoints" / "4")
  assert str(workdir / "damaged_checkpoints" / "4") in warnings
  state, data_state = trained["intact"][2]
  assert run.iterator.get_state() == data_state
  for a, b in zip(jax.tree.leaves(run.state), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_only_checkpoint_is_refused_in_one_line_naming_the_file(trained, tmp_path,
                                                                         damage):
  workdir = copy_checkpoints(trained["workdir"], tmp_path)
  shutil.rmtree(workdir / "checkpoints" / "2")
  path = DAMAGE[damage](workdir / "checkpoints" / "4")
  with pytest.raises(ckpt_lib.DamagedCheckpointError) as e:
    train_lib.train_and_evaluate(trained["config"], str(workdir))
  message = str(e.value)
  assert "\n" not in message and isinstance(e.value, UserError)
  assert message.startswith(f"no intact checkpoint in {workdir / 'checkpoints'} (4: {path}")
  assert (workdir / "checkpoints" / "4").exists()  # nothing moved when nothing is intact
  assert not (workdir / "metrics.jsonl").exists()  # no fresh start


def test_checkpoints_without_a_digest_are_refused(trained, tmp_path):
  """Checkpoints written before digests existed (no `digest.json`) cannot be verified."""
  workdir = copy_checkpoints(trained["workdir"], tmp_path)
  for step in (2, 4):
    os.remove(workdir / "checkpoints" / str(step) / digest_lib.DIGEST_FILE)
  with pytest.raises(ckpt_lib.DamagedCheckpointError,
                     match=r"^no intact checkpoint in .*checkpoints \(4: it has no digest\.json "
                           r"\(written before checkpoints carried a digest.*; 2: it has no"):
    train_lib.train_and_evaluate(trained["config"], str(workdir))


def test_an_empty_step_directory_falls_back(trained, tmp_path):
  workdir = copy_checkpoints(trained["workdir"], tmp_path)
  os.mkdir(workdir / "checkpoints" / "99")
  restored, warnings = restore(workdir, trained["abstract"], trained["config_dict"])
  assert restored.step == 4
  assert any("checkpoints/99 is damaged: the directory is empty" in w for w in warnings), warnings


def _cli(workdir):
  return subprocess.run(
      [sys.executable, "-m", "train.main", "--config=configs/packed.py:smoke",
       "--config.data.source=synthetic", "--config.data.synthetic_docs=300",
       "--config.attention.self_check=False", f"--workdir={workdir}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)


def test_cli_empty_step_directory_alone_exits_2_with_one_line(tmp_path):
  os.makedirs(tmp_path / "checkpoints" / "99")
  proc = _cli(tmp_path)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [
      f"python -m train.main: error: no intact checkpoint in {tmp_path / 'checkpoints'} (99: the directory is "
      "empty); move the damaged ones away (or use a new --workdir) to train from scratch"], (
          proc.stderr[-3000:])
  assert not (tmp_path / "metrics.jsonl").exists()  # no fresh start


def test_checkpoints_path_that_is_a_file_is_refused(tmp_path):
  (tmp_path / "checkpoints").write_text("not a directory")
  with pytest.raises(ckpt_lib.DamagedCheckpointError,
                     match=f"^{tmp_path / 'checkpoints'} is not a directory"):
    train_lib.train_and_evaluate(synthetic_config(**BASE), str(tmp_path))


def test_steps_to_remove_keeps_the_newest_verified():
  assert digest_lib.steps_to_remove([8, 6, 4, 2], verified={4}, keep=2) == [2]
  assert digest_lib.steps_to_remove([8, 6, 4, 2], verified={8, 4}, keep=2) == [2, 4]
  assert digest_lib.steps_to_remove([8, 6, 4, 2], verified=set(), keep=1) == [2, 4, 6]


def test_rotation_keeps_the_last_verified_checkpoint(trained, tmp_path, monkeypatch):
  """Steps 2 and 3 save without a recorded digest: with one checkpoint kept, orbax's rotation
  would leave only 3; ours keeps 1 (the newest verified) too, and a restore falls back to it."""
  write = digest_lib.write

  def write_only_1(step_dir, step):
    if step > 1:
      raise OSError(28, "No space left on device")
    return write(step_dir, step)

  monkeypatch.setattr(digest_lib, "write", write_only_1)
  state, data_state = trained["intact"][4]
  checkpointer = ckpt_lib.Checkpointer(tmp_path / "checkpoints", every=1, max_to_keep=1)
  for step in (1, 2, 3):
    assert checkpointer.maybe_save(step, state, data_state, trained["config_dict"])
    assert checkpointer.latest_step() == 1
  checkpointer.close()
  assert digest_lib.step_dirs(str(tmp_path / "checkpoints")) == [3, 1]
  monkeypatch.setattr(digest_lib, "write", write)
  restored, warnings = restore(tmp_path, trained["abstract"], trained["config_dict"])
  assert restored.step == 1
  assert any("checkpoints/3 is damaged: it has no digest.json" in w for w in warnings), warnings


CASES = 60


def test_random_byte_flips_are_refused_or_fall_back_or_change_nothing(trained, tmp_path):
  """Flip one random byte of one random file under `checkpoints/` (seeded), resume: a named
  refusal, a fallback whose warning names the damaged checkpoint (and restores exactly the older
  one), or exactly the intact restore; never a silently different state. Every third case keeps
  only the checkpoint of step 4, so a byte of it can only be refused."""
  rng = random.Random(0)
  base = trained["workdir"] / "checkpoints"
  files = sorted(os.path.relpath(os.path.join(r, n), base)
                 for r, _, names in os.walk(base) for n in names)
  outcomes = {"refused": 0, "fell_back": 0, "identical": 0}
  for case in range(CASES):
    workdir = copy_checkpoints(trained["workdir"], tmp_path / str(case))
    alone = case % 3 == 2
    if alone:
      shutil.rmtree(workdir / "checkpoints" / "2")
    rel = rng.choice([f for f in files if not alone or f.startswith("4" + os.sep)])
    path = workdir / "checkpoints" / rel
    data = bytearray(path.read_bytes())
    offset = rng.randrange(len(data))
    data[offset] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))
    damaged = rel.split(os.sep)[0]
    try:
      restored, warnings = restore(workdir, trained["abstract"], trained["config_dict"])
    except ckpt_lib.DamagedCheckpointError as e:
      assert alone and str(e).startswith(
          f"no intact checkpoint in {workdir / 'checkpoints'} (4: "), (rel, str(e))
      assert "\n" not in str(e)
      outcomes["refused"] += 1
      continue
    state, data_state = trained["intact"][restored.step]
    assert restored.data_state == data_state, (rel, offset)
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state)):
      np.testing.assert_array_equal(np.asarray(a), b, err_msg=f"{rel} byte {offset}")
    if restored.step == 4:
      assert damaged == "2" and not warnings, (rel, warnings)
      outcomes["identical"] += 1
    else:
      assert damaged == "4" and any("checkpoints/4 is damaged: " in w for w in warnings), (
          rel, warnings)
      outcomes["fell_back"] += 1
  print(f"byte flips: {CASES} cases, {outcomes}")
  assert sum(outcomes.values()) == CASES and all(outcomes.values()), outcomes

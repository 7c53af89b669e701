"""A finished run's saved config is complete or refused (`train.runs.saved.run_config`): the
readers of a run (`train.sample`, `train.export`) read its keys as they are, never with a
default, so a config lacking a key every config declares is refused in one line naming the key
and the checkpoint."""

import json

import pytest

from support.train_configs import one_step_run, synthetic_config
from train import checkpoint_digest as digest_lib
from train.runs import saved as saved_run
from train.runs.errors import RunError


def test_missing_keys_are_the_declared_ones_the_saved_config_lacks():
  saved = {"data": {"train": None, "source": "builtin"}, "model": {"rope_scaling": None}}
  missing = saved_run.missing_keys(saved)
  assert "data.train" not in missing and "data.source" not in missing
  assert "model.rope_scaling.factor" not in missing  # a value where the group was
  assert "data.add_bos" in missing and "train.seed" in missing


def test_a_saved_config_missing_a_key_is_refused_naming_it_and_the_checkpoint(tmp_path):
  workdir = tmp_path / "run"
  one_step_run(synthetic_config(), workdir)
  assert saved_run.run_config(str(workdir))[0].data.train is None  # complete: read as saved
  step_dir = workdir / "checkpoints" / "1"
  meta_file = step_dir / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  del meta["config"]["data"]["train"]
  meta["config"]["model"]["rope_scaling"] = None  # a value where a group was: not missing
  meta_file.write_text(json.dumps(meta))
  digest_lib.write(str(step_dir), 1)  # the digest now matches the edited config
  with pytest.raises(RunError) as refused:
    saved_run.run_config(str(workdir))
  assert str(refused.value) == (
      f"{workdir}/checkpoints/1: the run's saved config has no data.train (1 of the keys every "
      f"config declares); a run is read back from a complete config only")

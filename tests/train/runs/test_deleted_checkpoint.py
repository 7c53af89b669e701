"""A checkpoint the trainer deletes while a reader reads it (`train.max_checkpoints=1` removes the
previous one as it saves the next): `train.runs.loaded.load_run`, `run_config` and
`python -m train.export` choose the newest one again and read it (the step they report is
the one read); when every checkpoint goes, one line naming `--workdir`."""

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from support.train_configs import synthetic_config
from train import checkpoint_digest as digest_lib
from train import train as train_lib
from train.export import command as export_lib
from train.export import files as hf_export
from train.hf import weights as hf_weights
from train import sharding as sharding_lib
from train.runs import saved as saved_run
from train.runs import loaded as loaded_run
from train.runs.errors import RunError


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A workdir with the checkpoints of steps 2 and 4, and the parameters of each."""
  workdir = tmp_path_factory.mktemp("run")
  config = synthetic_config(**{
      "train.num_steps": 4, "train.checkpoint_every": 2, "train.max_checkpoints": 3,
      "train.eval_every": 0, "attention.self_check": False, "train.log_batches": False,
      "attention.implementation": "xla"})
  train_lib.train_and_evaluate(config, str(workdir))
  assert digest_lib.step_dirs(str(workdir / "checkpoints")) == [4, 2]
  params = {}
  for step in (4, 2):
    checkpoint = saved_run.Checkpoint(str(workdir / "checkpoints"), step)
    params[step] = _params(loaded_run.load_run(str(workdir), checkpoint=checkpoint)[1])
  assert not np.array_equal(params[4]["embed/embedding"], params[2]["embed/embedding"])
  return workdir, params


def _params(model):
  flat = {}
  jax.tree_util.tree_map_with_path(
      lambda p, x: flat.__setitem__(sharding_lib.param_name(p), np.asarray(x)),
      nnx.state(model, nnx.Param))
  return flat


def _copy(run, tmp_path):
  shutil.copytree(run[0], tmp_path / "run")
  return tmp_path / "run"


def _deleting(monkeypatch, workdir, steps):
  """The next `restore_item` calls first delete the checkpoint `steps[0]`, then `steps[1]`, ...
  as a trainer rotating its checkpoints would, just after the reader chose it."""
  restore, pending = saved_run.restore_item, list(steps)

  def deleting(checkpoint, method, **kwargs):
    if pending and checkpoint.step == pending[0]:
      shutil.rmtree(workdir / "checkpoints" / str(pending.pop(0)))
    return restore(checkpoint, method, **kwargs)

  monkeypatch.setattr(saved_run, "restore_item", deleting)
  return pending


def _same(got, want):
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_load_run_reads_the_other_checkpoint_when_the_chosen_one_is_deleted(run, tmp_path,
                                                                            monkeypatch):
  workdir = _copy(run, tmp_path)
  chosen = saved_run.choose_checkpoint(str(workdir))  # as train.sample chooses it first
  assert chosen.step == 4
  pending = _deleting(monkeypatch, workdir, [4])
  config, model, step = loaded_run.load_run(str(workdir), checkpoint=chosen)
  assert not pending and step == 2 and config.train.num_steps == 4
  _same(_params(model), run[1][2])
  assert saved_run.run_config(str(workdir), checkpoint=chosen)[1] == 2  # its config too


def test_export_writes_the_other_checkpoint_when_the_chosen_one_is_deleted(run, tmp_path,
                                                                           monkeypatch):
  from safetensors.numpy import load_file  # optional: the [hf] extra
  workdir = _copy(run, tmp_path)
  restore_params = export_lib.restore_params
  monkeypatch.setattr(hf_export, "write_files", lambda *a, **k: ((), False))  # no tokenizer
  pending = _deleting(monkeypatch, workdir, [])

  def deleted_first(checkpoint, config):  # the trainer deletes step 4 once config is read
    pending.append(4)
    monkeypatch.setattr(export_lib, "restore_params", restore_params)
    return restore_params(checkpoint, config)

  monkeypatch.setattr(export_lib, "restore_params", deleted_first)
  result = export_lib.export(workdir=str(workdir), output=str(tmp_path / "out"))
  assert not pending and result.step == 2
  written = load_file(str(tmp_path / "out" / hf_weights.SINGLE_NAME))
  assert np.array_equal(written["model.embed_tokens.weight"], run[1][2]["embed/embedding"])


def test_every_checkpoint_deleted_is_one_line_naming_the_workdir(run, tmp_path, monkeypatch):
  workdir = _copy(run, tmp_path)
  pending = _deleting(monkeypatch, workdir, [4, 2])
  with pytest.raises(RunError) as gone:
    loaded_run.load_run(str(workdir))
  assert not pending
  line = str(gone.value)
  assert "\n" not in line and type(gone.value) is RunError
  assert line.startswith(f"--workdir {str(workdir)!r} holds no checkpoint"), line
  assert f"the checkpoint being read, {workdir}/checkpoints/2, was deleted meanwhile" in line


def test_a_checkpoint_lost_every_time_gives_up_after_a_few(run, tmp_path, monkeypatch):
  workdir = _copy(run, tmp_path)
  calls = []

  def always_gone(checkpoint, method, **kwargs):  # a checkpoint deleted as each read begins
    calls.append(checkpoint.step)
    raise saved_run.CheckpointGone(f"{checkpoint.directory}/{checkpoint.step} was deleted")

  monkeypatch.setattr(saved_run, "restore_item", always_gone)
  with pytest.raises(RunError, match=rf"--workdir {str(workdir)!r}: 3 checkpoints in turn were "
                     r"deleted while they were read \(last .*/checkpoints/4\)"):
    saved_run.run_config(str(workdir))
  assert calls == [4, 4, 4]


def test_an_unreadable_intact_checkpoint_is_not_taken_for_a_deleted_one(run, tmp_path,
                                                                        monkeypatch):
  workdir = _copy(run, tmp_path)
  checkpoint = saved_run.choose_checkpoint(str(workdir))
  with pytest.raises(RunError) as refused:  # orbax refuses the call; the files are all there
    saved_run.restore_item(checkpoint, "restore", args="not orbax args")
  assert type(refused.value) is RunError and "cannot read" in str(refused.value)
  shutil.rmtree(workdir / "checkpoints" / "4" / "meta")  # now a file of it is gone
  with pytest.raises(saved_run.CheckpointGone, match=r"checkpoints/4 was deleted while it was "
                     r"read \(.*is missing"):
    saved_run.restore_item(checkpoint, "restore", args="not orbax args")


def test_the_sampler_reports_the_step_it_read(run, tmp_path, monkeypatch):
  from train.sample import command as sample_lib  # optional: the sampler reads runs
  workdir = _copy(run, tmp_path)
  chosen = saved_run.choose_checkpoint(str(workdir))
  _deleting(monkeypatch, workdir, [4])
  answers = sample_lib.sample(str(workdir), prompt_ids=["5,6,7"], max_new_tokens=2,
                              checkpoint=chosen)
  assert chosen.step == 4 and {a.step for a in answers} == {2}  # not the step first chosen

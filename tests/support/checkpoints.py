"""A trained workdir with two checkpoints and the restores of both, shared by the checkpoint
integrity and fault tests."""

import logging
import shutil

import jax
import numpy as np
import pytest

from support.train_configs import synthetic_config
from train import checkpoint as ckpt_lib
from train import checkpoint_digest as digest_lib
from train import train as train_lib
from train import setup as setup_lib


BASE = {"train.num_steps": 4, "train.checkpoint_every": 2, "train.max_checkpoints": 3,
        "train.eval_every": 0, "attention.self_check": False, "train.log_batches": False}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir with the checkpoints of steps 2 and 4, and the intact restores of both."""
  workdir = tmp_path_factory.mktemp("base")
  config = synthetic_config(**BASE)
  train_lib.train_and_evaluate(config, str(workdir))
  assert digest_lib.step_dirs(str(workdir / "checkpoints")) == [4, 2]
  probe = setup_lib.setup(config, str(tmp_path_factory.mktemp("probe")))  # a fresh state
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          probe.state)
  probe.checkpointer.close()
  intact = {}
  for drop in (None, 4):  # the newest, then (without 4) the older one
    copy = copy_checkpoints(workdir, tmp_path_factory.mktemp("intact"))
    if drop:
      shutil.rmtree(copy / "checkpoints" / str(drop))
    restored, _ = restore(copy, abstract, probe.config_dict)
    intact[restored.step] = (jax.tree.map(np.asarray, restored.state), restored.data_state)
  assert sorted(intact) == [2, 4]
  return dict(workdir=workdir, config=config, abstract=abstract,
              config_dict=probe.config_dict, intact=intact)


def copy_checkpoints(workdir, target):
  shutil.copytree(workdir / "checkpoints", target / "checkpoints")
  return target


def own_warnings(records):
  """The messages of the warnings `train.checkpoint` logged (not orbax's own logs)."""
  return [r.getMessage() for r in records
          if r.levelno >= logging.WARNING and r.pathname == ckpt_lib.__file__]


def restore(workdir, abstract, config_dict):
  """`(Restored, the checkpointer's warnings)` of a Checkpointer on `workdir/checkpoints`."""
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logger = logging.getLogger("absl")
  logger.addHandler(handler)
  checkpointer = ckpt_lib.Checkpointer(workdir / "checkpoints", every=2, max_to_keep=3)
  try:
    return checkpointer.restore_or_none(abstract, config_dict), own_warnings(records)
  finally:
    logger.removeHandler(handler)
    checkpointer.close()

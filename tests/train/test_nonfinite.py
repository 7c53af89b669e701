"""A non-finite loss, gradient norm, state or held-out loss stops the run (`NonFiniteError`, exit
code 2 from `train.main`) at the step that made it, and no checkpoint of a bad state is saved."""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from support.train_configs import synthetic_config
from train import sharding as sharding_lib
from train import run_guard
from train import train as train_lib
from train import steps as steps_lib
from train import setup as setup_lib
from train import state as state_lib
from segpack.errors import UserError
from support import paths

REPO = str(paths.REPO)
# Warmup 1 (the smoke config's): step 1 runs at learning rate 0, step 2 moves every parameter by
# ~1e10, so the logits of step 3 overflow (or the held-out loss right after step 2 does).
HUGE_LR = 1e10
ERROR = re.compile(r"step (\d+): the (loss|grad norm|eval loss) is (nan|inf|-inf); stopped without "
                   r"saving it, ")


class _Checkpointer:

  def __init__(self, latest):
    self.latest = latest

  def latest_step(self):
    return self.latest


def _metrics(loss=1.0, grad_norm=1.0, finite=True):
  return dict(loss=np.float32(loss), grad_norm=np.float32(grad_norm), finite=np.bool_(finite))


def test_check_finite_names_the_first_bad_step_and_value():
  kw = dict(checkpointer=_Checkpointer(4), learning_rate=0.1)
  run_guard.check_finite(5, [_metrics(), _metrics()], **kw)
  window = [_metrics(), _metrics(grad_norm=np.inf, finite=False), _metrics(np.nan, finite=False)]
  with pytest.raises(run_guard.NonFiniteError,
                     match=r"^step 6: the grad norm is inf; stopped without saving it, the "
                           r"checkpoint of step 4 is kept \(try a train.learning_rate lower than "
                           r"0.1,"):
    run_guard.check_finite(5, window, **kw)
  with pytest.raises(run_guard.NonFiniteError, match=r"^step 5: the loss is nan;"):
    run_guard.check_finite(5, window[2:], **kw)
  with pytest.raises(run_guard.NonFiniteError, match=r"^step 7: the new parameters or optimizer "
                     r"state are not finite; stopped without saving it, there is no checkpoint"):
    run_guard.check_finite(7, [_metrics(finite=False)], checkpointer=_Checkpointer(None),
                           learning_rate=0.1)
  with pytest.raises(run_guard.NonFiniteError, match=r"^step 3: the eval loss is nan;"):
    run_guard.check_finite(3, [dict(kind="eval", eval_loss=float("nan"))], **kw)
  assert issubclass(run_guard.NonFiniteError, UserError)


def test_the_step_flags_a_non_finite_state(tmp_path):
  """A finite loss and gradient norm with a non-finite update (learning rate inf) is flagged."""
  config = synthetic_config(**{"attention.self_check": False, "train.warmup_steps": 0})
  run = setup_lib.setup(config, str(tmp_path))
  batch = sharding_lib.global_batch(next(run.iterator), run.mesh)
  flags = {}
  for lr in (1e-3, float("inf")):  # inf: refused by the config checks, so built by hand here
    config.train.learning_rate = lr
    tx, schedule = steps_lib.make_optimizer(config.train)
    graphdef = state_lib.abstract_state(config, tx, vocab_size=run.vocab_size, mesh=run.mesh)[0]
    params = jax.tree.map(np.asarray, run.state["params"])
    state = dict(params=params, opt_state=tx.init(params), step=np.int32(0))
    step = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=1))
    metrics = jax.device_get(step(state, batch)[1])
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    flags[lr] = bool(metrics["finite"])
  assert flags == {1e-3: True, float("inf"): False}
  run.checkpointer.close()


@pytest.mark.parametrize("checkpoint_every, log_every", [(1, 3), (0, 1)])
def test_a_diverging_run_stops_at_the_bad_step_and_keeps_the_last_good_checkpoint(
    tmp_path, checkpoint_every, log_every):
  config = synthetic_config(**{"train.learning_rate": HUGE_LR, "train.num_steps": 6,
                         "train.checkpoint_every": checkpoint_every, "train.log_every": log_every,
                         "train.eval_every": 0, "attention.self_check": False})
  with pytest.raises(run_guard.NonFiniteError) as e:
    train_lib.train_and_evaluate(config, str(tmp_path))
  match = ERROR.match(str(e.value))
  assert match and "\n" not in str(e.value), str(e.value)
  bad = int(match.group(1))
  assert 2 <= bad <= 4, str(e.value)
  saved = sorted(int(name) for name in os.listdir(tmp_path / "checkpoints") if name.isdigit())
  # Every step before the bad one was saved (checkpoint_every=1, two kept); none at or after it.
  assert saved == ([s for s in (bad - 2, bad - 1) if s >= 1] if checkpoint_every else []), saved
  if saved:
    assert f"the checkpoint of step {saved[-1]} is kept" in str(e.value)
    run = setup_lib.setup(config, str(tmp_path))  # resumes from the last good checkpoint
    assert run.start_step == saved[-1]
    for leaf in jax.tree.leaves(run.state):
      assert np.isfinite(np.asarray(leaf)).all()
    run.checkpointer.close()


def test_cli_exits_2_with_one_line(tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "train.main", "--config=configs/packed.py:smoke",
       "--config.data.source=synthetic", "--config.data.synthetic_docs=300",
       "--config.data.synthetic_mean_len=30", f"--config.train.learning_rate={HUGE_LR}",
       f"--workdir={workdir}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("python -m train.main: error: step "), proc.stderr[-3000:]
  bad = int(ERROR.match(lines[0][len("python -m train.main: error: "):]).group(1))
  saved = [int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit()]
  assert all(s < bad for s in saved), (saved, lines)

"""A stop is prompt: with a slow device and logging far apart (the host free to dispatch steps
ahead), a SIGINT lands within two steps of the step the device was running, not where the host
had run ahead to."""

import os
import re
import signal
import threading
import time

import jax
import pytest

from support.train_configs import synthetic_config
from train import data as data_lib
from train import run_guard
from train import train as train_lib

SIGNAL_AT = 12  # the host's step when the signal is sent


def test_sigint_lands_within_two_steps_of_the_device(tmp_path, monkeypatch):
  done = {"steps": 0, "at_signal": None}
  lock = threading.Lock()

  def finished():
    time.sleep(0.15)  # a slow device step
    with lock:
      done["steps"] += 1

  real_make = train_lib.make_train_step

  def slow_make(*args, **kwargs):
    step = real_make(*args, **kwargs)

    def slow(state, batch):
      new_state, metrics = step(state, batch)
      jax.debug.callback(finished, ordered=False)
      return new_state, metrics
    return slow

  real_next, calls = data_lib.next_batch, {"n": 0}

  def next_batch(iterator):
    calls["n"] += 1
    if calls["n"] == SIGNAL_AT:
      with lock:
        done["at_signal"] = done["steps"]
      os.kill(os.getpid(), signal.SIGINT)
    return real_next(iterator)

  monkeypatch.setattr(train_lib, "make_train_step", slow_make)
  monkeypatch.setattr(data_lib, "next_batch", next_batch)
  config = synthetic_config(**{"train.num_steps": 40, "train.log_every": 1000,
                               "train.eval_every": 0, "train.checkpoint_every": 0,
                               "attention.self_check": False})
  with pytest.raises(run_guard.RunStopped, match=r"at step \d+") as stopped:
    train_lib.train_and_evaluate(config, tmp_path / "run")
  saved = int(re.search(r"at step (\d+)", str(stopped.value)).group(1))
  assert str(saved) in os.listdir(tmp_path / "run" / "checkpoints")
  assert done["at_signal"] is not None
  assert saved - done["at_signal"] <= 2, (saved, done["at_signal"])

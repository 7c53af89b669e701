"""The trainer configs: every key declared once in `configs/packed.py`, every string choice
checked in one place (`train.config_checks`), with an error naming the key, value and choices."""

import os
import subprocess
import sys

import pytest

from configs import packed, padded, sft
from segpack import loss as loss_lib
from segpack import packing
from segpack.data.packed import REPACK_MODES
from segpack.text import chat
from train import checkpoint as ckpt_lib
from train import config_checks
from train import data as data_lib
from train import train as train_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = {"packed": packed, "padded": padded, "sft": sft}


def _keys(config):
  return set(ckpt_lib.flatten(config.to_dict()))


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("arg", [None, "smoke", "gpu"])
def test_every_config_and_variant_passes_the_checks(name, arg):
  config = MODULES[name].get_config(arg)
  config_checks.check_config(config)
  # Every config declares exactly the keys of `configs/packed.py`: the others only change values.
  assert _keys(config) == _keys(packed.get_config())


def test_the_chat_keys_are_declared_with_the_packed_defaults():
  p, s = packed.get_config(), sft.get_config()
  assert (p.packing.mode, p.packing.examples_per_batch, p.packing.tokens_per_batch,
          p.data.train_on) == ("global", None, None, "assistant")
  assert (s.packing.mode, s.packing.examples_per_batch, s.packing.tokens_per_batch,
          s.data.train_on) == ("minibatch", 16, None, "assistant")
  spec = data_lib.DataSpec.from_config(p)
  assert (spec.mode, spec.balance, spec.repack, spec.train_on) == (
      "global", "none", "none", "assistant")


def test_the_choices_are_the_library_tuples():
  choices = config_checks.CHOICES
  assert choices["packing.repack"] is REPACK_MODES
  assert choices["packing.long_docs"] is packing.LONG_DOCS
  assert choices["loss.weighting"] is loss_lib.WEIGHTINGS
  assert choices["data.train_on"] is chat.TRAIN_ON
  assert set(choices["packing.strategy"]) == set(packing.STRATEGIES)
  assert choices["packing.balance"] is config_checks.BALANCE_MODES
  assert choices["packing.mode"] is config_checks.PACKING_MODES
  assert choices["data.source"] is config_checks.SOURCES


@pytest.mark.parametrize("key", sorted(config_checks.CHOICES))
def test_a_bad_string_choice_names_the_key_the_value_and_every_choice(key):
  config = packed.get_config("smoke")
  group, name = key.split(".")
  config[group][name] = "nope"
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_config(config)
  message = str(e.value)
  assert isinstance(e.value, ValueError)
  assert message.startswith(f"{key} must be one of ") and message.endswith("got 'nope'")
  for choice in config_checks.CHOICES[key]:
    assert repr(choice) in message, choice


def test_the_trainer_checks_before_any_work(tmp_path):
  config = packed.get_config("smoke")
  config.loss.weighting = "mean"
  workdir = tmp_path / "run"
  with pytest.raises(config_checks.ConfigError, match=r"loss.weighting .*'sequence'.*'mean'"):
    train_lib.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


def test_the_data_code_checks_with_the_same_tuples():
  config = packed.get_config("smoke")
  config.data.source = "synthetic"
  config.data.synthetic_docs, config.data.synthetic_mean_len = 40, 20
  spec = data_lib.DataSpec.from_config(config)

  def make(**kw):
    return data_lib.make_data(data_lib.DataSpec(**{**spec.__dict__, **kw}), batch_size=8,
                              process_index=0, process_count=1)

  with pytest.raises(data_lib.DataConfigError,
                     match=r"packing.balance must be one of \['none', 'attention'\], got 'cost'"):
    make(balance="cost")
  with pytest.raises(data_lib.DataConfigError,
                     match=r"packing.mode must be one of \['global', 'minibatch'\], got 'mini'"):
    make(mode="mini")
  with pytest.raises(data_lib.DataConfigError, match=r"data.source must be one of "
                     r"\['builtin', 'builtin_chat', 'synthetic'\], got 'web'"):
    make(source="web")


def test_cli_override_with_a_bad_choice_is_refused(tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "train.main", "--config=configs/sft.py:smoke",
       "--config.packing.mode=mini", f"--workdir={workdir}"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  # One line, no traceback.
  assert proc.stderr.strip().splitlines() == [
      "train.main: packing.mode must be one of ['global', 'minibatch'], got 'mini'"], proc.stderr
  assert not workdir.exists()

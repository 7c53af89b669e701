"""The trainer configs: every key declared once in `configs/packed.py`, every string choice
checked in one place (`train.config_checks`), with an error naming the key, value and choices."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import grpo, packed, padded, sft
from segpack import loss as loss_lib
from segpack import packing
from segpack.data.packed import REPACK_MODES
from segpack.text import chat
from train import checkpoint_compat as ckpt_compat
from train import config_checks
from train import train as train_lib
from train import setup as setup_lib
from support import train_configs
from support import paths

REPO = str(paths.REPO)
MODULES = {"packed": packed, "padded": padded, "sft": sft, "grpo": grpo}


def _keys(config):
  return set(ckpt_compat.flatten(config.to_dict()))


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
  assert (p.packing.balance, p.packing.repack) == ("none", "none")


def test_the_choices_are_the_library_tuples():
  choices = config_checks.CHOICES
  assert choices["packing.repack"] is REPACK_MODES
  assert choices["packing.long_docs"] is packing.LONG_DOC_MODES
  assert choices["loss.weighting"] is loss_lib.WEIGHTINGS
  assert choices["data.train_on"] is chat.TRAIN_ON
  assert set(choices["packing.strategy"]) == set(packing.STRATEGIES)
  assert choices["packing.balance"] is config_checks.BALANCE_MODES
  assert choices["packing.mode"] is config_checks.PACKING_MODES
  assert choices["data.source"] is config_checks.SOURCES


@pytest.mark.parametrize("key", sorted(config_checks.CHOICES))
def test_a_bad_string_choice_names_the_key_the_value_and_every_choice(key):
  config = packed.get_config("smoke")
  group, name = _parent(config, key)
  group[name] = "nope"
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


def test_cli_override_with_a_bad_choice_is_refused(tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "train.main", "--config=configs/sft.py:smoke",
       "--config.packing.mode=mini", f"--workdir={workdir}"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  # One line, no traceback.
  assert proc.stderr.strip().splitlines() == [
      "python -m train.main: error: packing.mode must be one of ['global', 'minibatch'], got 'mini'"], proc.stderr
  assert not workdir.exists()


# Values each numeric key must refuse; every key of `config_checks.NUMERIC` has some.
BAD_NUMBERS = {
    "data.eval_share": [-0.1, 1.0, float("nan")],
    "data.tokens_per_epoch": [0, -5],
    "data.synthetic_docs": [0],
    "data.synthetic_mean_len": [0, -1],
    "data.synthetic_vocab": [3, 0],
    "packing.seq_len": [1, 0, -64],
    "packing.max_segments_per_row": [0],
    "packing.examples_per_batch": [0],
    "packing.tokens_per_batch": [0],
    "train.num_steps": [0, -1],
    "train.batch_size": [0],
    "train.grad_accum_steps": [0, -2],
    "train.learning_rate": [float("nan"), float("inf"), -1e-3],
    "train.warmup_steps": [-1],
    "train.min_lr_ratio": [-0.1, 1.5, float("nan")],
    "train.weight_decay": [-0.1, float("inf")],
    "train.b1": [1.0, -0.1],
    "train.b2": [1.0, float("nan")],
    "train.eps": [0.0, -1e-8],
    "train.grad_clip": [-1.0, float("nan")],
    "train.log_every": [0],
    "train.eval_every": [-1],
    "train.eval_batches": [-1],
    "train.checkpoint_every": [-1],
    "train.max_checkpoints": [0, -1],
    "train.peak_flops": [0.0, -1.0, float("inf")],
    "model.sliding_window": [0, -4096],
    "model.max_position_embeddings": [0],
    "model.rope_scaling.factor": [0.0, -2.0, float("nan")],
    "model.lora.rank": [-1, -16],
    "model.lora.alpha": [0.0, -16.0, float("inf")],
    "model.lora.dropout": [1.0, -0.1, float("nan")],
    "loss.block_size": [-1],
    "loss.vocab_block_size": [-8],
    "train.num_epochs": [0.0, -1.0, float("inf")],
    "preference.beta": [0.0, -0.1, float("nan")],
    "preference.label_smoothing": [0.5, -0.1, float("nan")],
    "preference.simpo_gamma": [-0.5, float("inf")],
    "rl.num_generations": [0],
    "rl.prompts_per_step": [0, -2],
    "rl.max_completion_length": [0],
    "rl.temperature": [0.0, -1.0, float("nan")],
    "rl.top_p": [0.0, 1.5],
    "rl.top_k": [-1],
    "rl.epsilon": [1.0, -0.1],
    "rl.epsilon_high": [-0.1, float("inf")],
    "rl.beta": [-0.01, float("nan")],
    "rl.inner_steps": [0],
    "rl.overlong_buffer": [-1],
    "rl.lanes": [-1],
}
# Boundary values each numeric key accepts (0 means "never" / "all" / "only at the end" where the
# config says so; None "the default" for the optional keys).
GOOD_NUMBERS = {
    "data.eval_share": 0.0, "data.tokens_per_epoch": None, "packing.seq_len": 2,
    "packing.max_segments_per_row": None, "packing.examples_per_batch": 1,
    "train.learning_rate": 0.0, "train.warmup_steps": 0, "train.min_lr_ratio": 1.0,
    "train.b1": 0.0, "train.grad_clip": 0.0, "train.eval_every": 0, "train.eval_batches": 0,
    "train.checkpoint_every": 0, "train.max_checkpoints": 1, "train.peak_flops": None,
    "train.log_every": 1, "data.synthetic_vocab": 4, "model.sliding_window": None,
    "model.max_position_embeddings": 1, "loss.block_size": 0, "loss.vocab_block_size": 0,
    "preference.label_smoothing": 0.0, "preference.simpo_gamma": 0.0,
    "train.num_steps": None, "train.num_epochs": None, "model.lora.rank": 0,
    "model.lora.alpha": 1e-3, "model.lora.dropout": 0.0,
    "rl.top_p": 1.0, "rl.top_k": 0, "rl.epsilon": 0.0, "rl.epsilon_high": None, "rl.beta": 0.0,
    "rl.overlong_buffer": 0, "rl.lanes": 0,
}


def _parent(config, key):
  """`(the ConfigDict holding the key, its last name)` for a dotted key (`model.rope_scaling.type`)."""
  *groups, name = key.split(".")
  for group in groups:
    config = config[group]
  return config, name


def test_every_numeric_key_has_bad_values():
  assert set(BAD_NUMBERS) == set(config_checks.NUMERIC)
  assert set(GOOD_NUMBERS) <= set(config_checks.NUMERIC)
  assert not set(config_checks.NUMERIC) & set(config_checks.CHOICES)


@pytest.mark.parametrize("key, value", [(k, v) for k, vs in sorted(BAD_NUMBERS.items())
                                        for v in vs])
def test_a_bad_number_names_the_key_the_value_and_the_rule(key, value):
  config = packed.get_config("smoke")
  group, name = _parent(config, key)
  group[name] = value
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_config(config)
  rule = config_checks.NUMERIC[key].describe()
  assert str(e.value) == f"{key} must be {rule}, got {group[name]!r}"


@pytest.mark.parametrize("key", sorted(GOOD_NUMBERS))
def test_a_boundary_number_is_accepted(key):
  config = packed.get_config("smoke")
  group, name = _parent(config, key)
  group[name] = GOOD_NUMBERS[key]
  config_checks.check_config(config)


def test_the_rules_read_as_bounds():
  numeric = config_checks.NUMERIC
  assert numeric["data.eval_share"].describe() == "in [0, 1)"
  assert numeric["train.min_lr_ratio"].describe() == "in [0, 1]"
  assert numeric["train.num_steps"].describe() == "a finite number >= 1 or None"
  assert numeric["train.batch_size"].describe() == "a finite number >= 1"
  assert numeric["train.eps"].describe() == "a finite number > 0"
  assert numeric["packing.tokens_per_batch"].describe() == "a finite number >= 1 or None"


def test_grad_accum_zero_is_refused_before_any_work(tmp_path):
  config = packed.get_config("smoke")
  config.train.grad_accum_steps = 0
  workdir = tmp_path / "run"
  with pytest.raises(config_checks.ConfigError,
                     match=r"^train.grad_accum_steps must be a finite number >= 1, got 0$"):
    train_lib.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


def _vocab_config(vocab_size):
  config = packed.get_config("smoke")
  config.data.source = "synthetic"
  config.data.synthetic_docs, config.data.synthetic_mean_len = 60, 20
  config.data.synthetic_vocab = 97
  config.attention.self_check = False
  config.model.vocab_size = vocab_size
  return config


def test_check_vocab_size():
  assert config_checks.check_vocab_size(_vocab_config(None), 97) == 97
  assert config_checks.check_vocab_size(_vocab_config(97), 97) == 97
  assert config_checks.check_vocab_size(_vocab_config(128), 97) == 128
  with pytest.raises(config_checks.ConfigError,
                     match=r"^model.vocab_size must be None \(the data's\) or at least the data's "
                           r"vocabulary size 97, got 16$"):
    config_checks.check_vocab_size(_vocab_config(16), 97)


@pytest.mark.parametrize("vocab_size, rows", [(None, 97), (128, 128)])
def test_the_trainer_honours_model_vocab_size(tmp_path, vocab_size, rows):
  run = setup_lib.setup(_vocab_config(vocab_size), str(tmp_path))
  assert run.data.vocab_size == 97 and run.vocab_size == rows
  shapes = {tuple(np.shape(x)) for x in jax.tree.leaves(run.state["params"])}
  assert (rows, 64) in shapes and (64, rows) in shapes  # embedding table and output projection
  run.checkpointer.close()


def test_the_trainer_refuses_a_vocab_smaller_than_the_data(tmp_path):
  with pytest.raises(config_checks.ConfigError, match=r"vocabulary size 97, got 16$"):
    setup_lib.setup(_vocab_config(16), str(tmp_path))


def _cli(*args, workdir):
  return subprocess.run([sys.executable, "-m", "train.main", *args, f"--workdir={workdir}"],
                        cwd=REPO, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, XLA_FLAGS=train_configs.one_cpu_device()))


@pytest.mark.parametrize("args, line", [
    (["--config=configs/packed.py:nope"],
     "python -m train.main: error: --config=configs/packed.py:nope: unknown config variant 'nope': the variants are "
     "['gpu', 'long', 'smoke'] (--config=FILE:VARIANT), or none"),
    (["--config=configs/sft.py:nope", "--config.train.num_steps=2"],
     "python -m train.main: error: --config=configs/sft.py:nope: unknown config variant 'nope': the variants are "
     "['gpu', 'long', 'smoke'] (--config=FILE:VARIANT), or none"),
    (["--config", "configs/nope.py:smoke", "--config.train.num_steps=2"],
     f"python -m train.main: error: --config=configs/nope.py:smoke: no config file 'configs/nope.py' (from {REPO!r})"),
    (["--config=configs/packed.py:smoke", "--config.train.num_stpes=2"],
     "python -m train.main: error: a --config.* override names no config key: 'num_stpes' Did you mean "
     "\"num_steps\" instead of \"num_stpes\"?"),
    (["--config=configs/packed.py:smoke", "--config.train.num_steps=abc"],
     "python -m train.main: error: flag --config.train.num_steps=abc: invalid literal for int() with base 10: 'abc'"),
    (["--config=configs/packed.py:smoke", "--config.train.max_checkpoints=0"],
     "python -m train.main: error: train.max_checkpoints must be a finite number >= 1, got 0"),
    (["--config=configs/packed.py:smoke", "--config.data.source=synthetic",
      "--config.model.vocab_size=16"],
     "python -m train.main: error: model.vocab_size must be None (the data's) or at least the data's vocabulary "
     "size 512, got 16"),
    (["--config=configs/packed.py:smoke", "--config.data.source=synthetic",
      "--config.mesh.data=2"],  # the command sees one CPU device
     "python -m train.main: error: mesh: axes {'data': 2, 'fsdp': 1, 'context': 1, "
     "'tensor': 1} need 2 devices, but there are 1"),
], ids=["variant", "sft-variant", "missing-file", "key-typo", "bad-int", "max-checkpoints",
        "vocab", "mesh"])
def test_cli_config_mistakes_exit_2_with_one_line(tmp_path, args, line):
  proc = _cli(*args, "--config.attention.self_check=False", workdir=tmp_path / "run")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [line], proc.stderr[-3000:]


@pytest.mark.parametrize("keys,match", [
    (dict(balance="attention"), r"packing.balance='attention' is for packing.mode='global'"),
    (dict(repack="epoch"), r"packing.repack='epoch' is for packing.mode='global'"),
    (dict(max_segments_per_row=4), r"packing.max_segments_per_row=4 is not supported"),
    (dict(tokens_per_batch=128 * 4, examples_per_batch=None),
     r"packing.tokens_per_batch=512 gives 4 rows of seq_len 128 per step, but "
     r"train.batch_size=10"),
])
def test_a_key_minibatch_mode_does_not_combine_with_is_refused_before_any_work(keys, match):
  config = sft.get_config()
  assert config.packing.mode == "minibatch"
  config_checks.check_config(config)  # the control: sft's own keys pass
  config.packing.seq_len = 128
  for name, value in keys.items():
    config.packing[name] = value
  with pytest.raises(config_checks.ConfigError, match=match):
    config_checks.check_config(config)
  config.packing.mode = "global"  # the same keys are fine with global packing
  config_checks.check_config(config)


@pytest.mark.parametrize("keys,match", [
    ({"num_kv_heads": 3}, r"^model.num_heads=4 must be a multiple of num_kv_heads=3$"),
    ({"head_dim": 15}, r"^model.head_dim must be even for RoPE, got 15$"),
    ({"d_ff": 0}, r"^model.d_ff must be a positive int, got 0$"),
    ({"rope_scaling.type": "llama3", "rope_scaling.factor": 8.0},
     r"^model.rope_scaling.type='llama3' needs model.rope_scaling.original_max_position_embeddings"),
])
def test_a_model_mistake_is_refused_before_any_work_naming_the_model_key(keys, match):
  config = packed.get_config("smoke")
  config_checks.check_config(config)  # the control
  for key, value in keys.items():
    group = config.model
    *parents, name = key.split(".")
    for parent in parents:
      group = group[parent]
    group[name] = value
  with pytest.raises(ValueError, match=match):
    config_checks.check_config(config)


@pytest.mark.parametrize("key, value", [("data.train", None), ("packing.mode", "minibatch"),
                                        ("mesh.context", 2),
                                        ("packing.max_segments_per_row", 4)])
def test_a_preference_loss_refuses_what_pairs_cannot_do_naming_the_key(key, value):
  from configs import dpo
  config = dpo.get_config("smoke")
  config.data.train = "data/pairs"
  group, name = key.split(".")
  config[group][name] = value
  with pytest.raises(config_checks.ConfigError, match=rf"preference.loss='dpo' with {key}="):
    config_checks.check_preference(config)
  config[group][name] = dpo.get_config("smoke")[group][name]
  if key == "data.train":
    config.data.train = "data/pairs"
  config_checks.check_preference(config)  # the same config without the clash passes

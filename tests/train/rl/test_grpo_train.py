"""GRPO in the trainer (`configs/grpo.py`) on the toy task of `support.rl_toy`: held-out accuracy
rises from its start and the negated reward does not; the ratio is exactly 1 at a round's first
inner step and not at its second; rollouts are kept; a run resumed inside a round equals the
uninterrupted one; bad input is one line."""

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")

from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from support import rl_toy  # noqa: E402
from support.paths import REPO  # noqa: E402
from support.train_configs import run_cli  # noqa: E402
from train import train as train_lib  # noqa: E402
from train.data_sources import DataConfigError  # noqa: E402
from train.rl import rewards as rewards_lib  # noqa: E402
from train.rl.settings import RLConfigError  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return rl_toy.make_datasets(str(tmp_path_factory.mktemp("toy")))


def _records(workdir, kind):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_held_out_accuracy_rises_and_the_negated_reward_does_not(data, tmp_path):
  runs = {}
  for name, rewards in (("plain", "exact"), ("negated", "exact=-1")):
    config = rl_toy.config(data, train__num_steps=60, train__eval_every=60, train__log_every=5,
                           rl__rewards=rewards)
    train_lib.train_and_evaluate(config, tmp_path / name)
    runs[name] = (_records(tmp_path / name, "eval"), _records(tmp_path / name, "train"))
  (first, last), train = runs["plain"][0], runs["plain"][1]
  assert first["eval_accuracy"] <= 0.2 and last["eval_accuracy"] >= 0.6, (first, last)
  rewards = [r["reward"] for r in train]
  assert np.mean(rewards[-3:]) > np.mean(rewards[:2]) + 0.3, rewards  # the reward curve rises
  (first, last), _ = runs["negated"]
  assert last["eval_accuracy"] <= first["eval_accuracy"] + 0.05, (first, last)


def test_the_ratio_is_one_at_a_rounds_first_inner_step_and_rollouts_are_kept(data, tmp_path):
  config = rl_toy.config(data, train__num_steps=6, rl__inner_steps=2,
                         rl__max_completion_length=3, train__learning_rate=1e-2,
                         train__warmup_steps=0, rl__rewards="gsm8k_flexible",
                         rl__prompts_per_step=6)  # a round's 6 groups fill one step's rows
  train_lib.train_and_evaluate(config, tmp_path / "run")
  steps = _records(tmp_path / "run", "train")
  for first in steps[::2]:
    assert first["ratio"] == pytest.approx(1.0, abs=1e-6) and first["clip_fraction"] == 0
  for second in steps[3::2]:  # rounds 1 and 2 (round 0's rewards are all 0: nothing moves)
    assert abs(second["ratio"] - 1.0) > 1e-5  # the weights moved: the control
  assert steps[0]["logp_mismatch_median"] < 1e-4  # sampler and trainer agree
  assert all(0 < r["entropy"] <= np.log(28) + 1e-5 for r in steps)  # 28: the toy's vocabulary
  for key in ("reward", "reward_std", "accuracy", "completion_length", "truncated_share",
              "kl", "entropy", "sample_s", "score_s", "rewards/gsm8k_flexible"):
    assert key in steps[0], key
  kept = sorted(os.listdir(tmp_path / "run" / "rollouts"))
  assert kept == [f"round-{r:06d}.{x}" for r in range(3) for x in ("jsonl", "npz")]
  lines = [json.loads(x) for x in open(tmp_path / "run" / "rollouts" / kept[0])]
  assert len(lines) == 6 * 8
  assert {"prompt", "completion", "token_ids", "logprobs", "reward", "advantage",
          "finish_reason", "record"} <= set(lines[0])
  group = [x["advantage"] for x in lines if x["prompt_index"] == lines[0]["prompt_index"]]
  assert abs(sum(group)) < 1e-4  # advantages of a group sum to 0


def test_a_run_resumed_inside_a_round_equals_the_uninterrupted_one(data, tmp_path):
  keys = dict(rl__inner_steps=2, rl__max_completion_length=3, rl__prompts_per_step=4,
              train__learning_rate=1e-2)
  whole = rl_toy.config(data, train__num_steps=4, **keys)
  train_lib.train_and_evaluate(whole, tmp_path / "whole")
  part = rl_toy.config(data, train__num_steps=3, **keys)
  train_lib.train_and_evaluate(part, tmp_path / "part")  # stops inside round 1
  train_lib.train_and_evaluate(whole, tmp_path / "part")
  a, b = _records(tmp_path / "whole", "train"), _records(tmp_path / "part", "train")
  assert [r["step"] for r in b] == [1, 2, 3, 4]
  for x, y in zip(a, b):
    assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"]), (x, y)
  for name in ("round-000000.jsonl", "round-000001.jsonl"):
    assert (open(tmp_path / "whole" / "rollouts" / name).read() ==
            open(tmp_path / "part" / "rollouts" / name).read())


def test_bad_input_is_refused_by_name(data, tmp_path):
  no_answer = tmp_path / "no_answer.jsonl"
  no_answer.write_text('{"prompt": "w1 3 ="}\n{"prompt": "w2 4 =", "answer": "4"}\n')
  text = tmp_path / "text.jsonl"
  text.write_text('{"text": "w1 w2 3"}\n')
  for name, src, fmt in (("no_answer", no_answer, "prompts"), ("text", text, "text")):
    assert tokenize_cli.main(["--input", str(src), "--output", str(tmp_path / name),
                              "--format", fmt, "--tokenizer", f"hf:{data['tokenizer']}",
                              "--no-progress"]) == 0
  for keys, error, match in (
      (dict(data__train=str(tmp_path / "no_answer"), data__eval=None),
       rewards_lib.RewardError, r"reward 'exact' reads the field 'answer' of every prompt "
       r"record; .*no_answer' record 0 has \['prompt'\]"),
      (dict(data__train=str(tmp_path / "text"), data__eval=None), DataConfigError,
       r"samples completions of the prompts of one dataset written by `segpack tokenize "
       r"--format prompts`; data.train=.* is not one \(its manifest has no metadata.prompts\)"),
      (dict(rl__num_generations=1), RLConfigError,
       r"rl.num_generations=1 with rl.loss='grpo': a group of one has no reward std"),
      (dict(rl__num_generations=64, rl__max_completion_length=8, packing__seq_len=256),
       DataConfigError, r"needs [0-9]+ slots, more than packing.seq_len=256"),
      (dict(rl__rewards="exact=two"), rewards_lib.RewardError, r"'exact=two' is not NAME"),
  ):
    with pytest.raises(error, match=match):
      train_lib.train_and_evaluate(rl_toy.config(data, train__num_steps=1, **keys),
                                   tmp_path / "w")


def test_a_reward_that_raises_or_returns_nan_ends_the_command_in_one_line(data, tmp_path):
  (tmp_path / "my_reward.py").write_text(
      "def boom(prompt, completion, record):\n  raise KeyError('x')\n"
      "def nan(prompt, completion, record):\n  return float('nan')\n")
  out = run_cli("train.main", "--config=configs/grpo.py:smoke",
                f"--config.data.train={data['train']}", "--config.train.num_steps=1",
                "--config.rl.rewards=my_reward:boom", f"--workdir={tmp_path / 'boom'}",
                env=dict(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}"), check=False)
  lines = out.stderr.strip().splitlines()
  match = "reward 'my_reward:boom' raised KeyError: 'x' on held-out "
  assert out.returncode == 2 and len(lines) == 1 and match in lines[0], out.stderr[-2000:]
  sys.path.insert(0, str(tmp_path))  # the same in-process, for the NaN: no second command
  try:
    with pytest.raises(rewards_lib.RewardError, match="reward 'my_reward:nan' returned nan on "):
      train_lib.train_and_evaluate(rl_toy.config(data, train__num_steps=1,
                                                 rl__rewards="my_reward:nan"), tmp_path / "nan")
  finally:
    sys.path.remove(str(tmp_path))


def test_an_fsdp_mesh_trains_what_the_data_mesh_does(data, tmp_path):
  """8 devices as data=8 and as data=4 x fsdp=2 (parameters and optimizer state split), with the
  KL term: the same losses, gradient norms and KL, step by step."""
  runs = {}
  for name, keys in (("data", {}), ("fsdp", dict(mesh__fsdp=2))):
    config = rl_toy.config(data, train__num_steps=3, rl__beta=0.04, train__warmup_steps=0,
                           rl__max_completion_length=2, rl__rewards="gsm8k_flexible", **keys)
    train_lib.train_and_evaluate(config, tmp_path / name)
    runs[name] = [(r["loss"], r["grad_norm"], r["kl"]) for r in _records(tmp_path / name, "train")]
  assert runs["data"][2][2] > 0  # the KL term is live by step 3
  np.testing.assert_allclose(runs["fsdp"], runs["data"], rtol=1e-5, atol=1e-7)

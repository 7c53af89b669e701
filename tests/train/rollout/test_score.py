"""`python -m train.rollout.score` on what `python -m train.sample --output` wrote: the trainer's
packed scoring of the sampled tokens equals the sampler's log-probs (the contract, end to end
through both commands), another temperature does not (the negative control), and its mistakes
are one line each."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from support import paths
from support import train_configs
from support.train_configs import one_step_run, synthetic_config
from train.rollout import score as score_lib

REPO = str(paths.REPO)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
  """A one-step synthetic run and 2 prompts x 3 drawn completions of it at temperature 0.8."""
  root = tmp_path_factory.mktemp("score")
  one_step_run(synthetic_config(**{"attention.implementation": "xla"}), root / "run")
  proc = subprocess.run(
      [sys.executable, "-m", "train.sample", f"--workdir={root / 'run'}", "--prompt_ids=1,5,6,7",
       "--prompt_ids=1,9", "--num_samples=3", "--temperature=0.8", "--max_new_tokens=12",
       f"--output={root / 'answers.jsonl'}"], cwd=REPO, capture_output=True, text=True,
      timeout=300, env=dict(os.environ, XLA_FLAGS=train_configs.one_cpu_device()))
  assert proc.returncode == 0, proc.stderr
  return root


def _score(root, *extra):
  return score_lib.main([f"--workdir={root / 'run'}", f"--completions={root / 'answers.jsonl'}",
                         *extra])


def test_the_trainers_scores_are_the_samplers_logprobs(sampled, capsys):
  lines = [json.loads(x) for x in (sampled / "answers.jsonl").read_text().splitlines()]
  assert len(lines) == 6 and {x["temperature"] for x in lines} == {0.8}
  assert _score(sampled, f"--output={sampled / 'scores.jsonl'}") == 0
  assert not (sampled / "scores.jsonl.lock").exists()  # the lock goes with the command
  assert "largest difference from the sampler's log-probs" in capsys.readouterr().out
  scores = [json.loads(x) for x in (sampled / "scores.jsonl").read_text().splitlines()]
  for line, got in zip(lines, scores):
    assert (got["prompt"], got["sample"]) == (line["prompt"], line["sample"])
    np.testing.assert_allclose(got["logprobs"], line["logprobs"], atol=1e-5)
  assert _score(sampled, f"--output={sampled / 'hot.jsonl'}", "--temperature=1.5") == 0
  hot = [json.loads(x) for x in (sampled / "hot.jsonl").read_text().splitlines()]
  assert max(np.abs(np.subtract(h["logprobs"], x["logprobs"])).max()
             for h, x in zip(hot, lines)) > 1e-2


def test_mistakes_are_one_line(sampled, capsys, tmp_path):
  (sampled / "taken.jsonl").write_text("")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt_ids": [1, 2], "token_ids": [3]}\n{"token_ids": [1]}\n')
  for args, message in (
      ([f"--output={sampled / 'taken.jsonl'}"], "the file exists"),
      ([f"--output={tmp_path / 'o.jsonl'}", f"--completions={bad}"], f"{bad}:2: a line needs"),
      ([f"--output={tmp_path / 'o.jsonl'}", f"--completions={tmp_path / 'none.jsonl'}"],
       "--completions"),
  ):
    assert score_lib.main([f"--workdir={sampled / 'run'}",
                           f"--completions={sampled / 'answers.jsonl'}", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
  assert not (tmp_path / "o.jsonl").exists()

"""The command lines: `segpack COMMAND` (declared subcommands), `python -m train.bench BENCHMARK`,
and one flag style (`--seq-len`: dashes, never underscores) in every one of them."""

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from segpack.attention import resources as resources_lib
from segpack.cli import main as cli_main
from segpack.shards import ShardSource
from segpack.text import corpus
from train.bench import training as train_bench
from train import plot as train_plot
from support import paths

ROOT = paths.REPO


def _exit_status(main, argv) -> int:
  """`main(argv)`'s exit status, whether it returns or raises `SystemExit` (argparse)."""
  try:
    return main(argv)
  except SystemExit as e:
    return e.code


# Every help screen: (entry point, argv, the `usage:` prog it must print).
HELP = [
    (cli_main.main, ["--help"], "segpack"),
    (cli_main.main, ["tokenize", "--help"], "segpack tokenize"),
    (cli_main.main, ["stats", "--help"], "segpack stats"),
    (cli_main.main, ["bench", "--help"], "segpack bench"),
    (cli_main.main, ["bench", "packing", "--help"], "segpack bench packing"),
    (cli_main.main, ["bench", "attention", "--help"], "segpack bench attention"),
    (cli_main.main, ["bench", "tokenize", "--help"], "segpack bench tokenize"),
    (cli_main.main, ["bench", "gpu-report", "--help"], "segpack bench gpu-report"),
    (train_bench.main, ["--help"], "python -m train.bench"),
    (train_bench.main, ["packed", "--help"], "python -m train.bench packed"),
    (train_bench.main, ["sft", "--help"], "python -m train.bench sft"),
    (train_plot.main, ["--help"], "python -m train.plot"),
    (resources_lib.main, ["--help"], "python -m segpack.attention.resources"),
]


@pytest.mark.parametrize("main,argv,prog", HELP, ids=[" ".join([p, *a]) for _, a, p in HELP])
def test_help_exits_zero_names_the_command_and_uses_dashed_flags(main, argv, prog, capsys):
  assert _exit_status(main, argv) == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: {prog} "), out[:200]
  flags = re.findall(r"(?<![\w-])--[a-z][\w-]*", out)
  assert "--help" in flags or "-h" in out
  assert not [f for f in flags if "_" in f], f"{prog}: flags with underscores"


def test_segpack_help_lists_every_command(capsys):
  assert _exit_status(cli_main.main, ["--help"]) == 0
  out = capsys.readouterr().out
  for command in ("tokenize", "stats", "bench"):
    assert re.search(rf"^\s+{command}\s", out, re.M), command
  assert _exit_status(cli_main.main, ["bench", "--help"]) == 0
  out = capsys.readouterr().out
  for benchmark in ("packing", "attention", "gpu-report"):
    assert re.search(rf"^\s+{benchmark}\s", out, re.M), benchmark


@pytest.mark.parametrize("argv,message", [
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
    (["bench", "speed"], "argument BENCHMARK: invalid choice: 'speed'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_segpack_unknown_or_missing_command_exits_2(argv, message, capsys):
  assert _exit_status(cli_main.main, argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("usage: segpack") and message in err, err


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: BENCHMARK"),
    (["--sft"], "the following arguments are required: BENCHMARK"),
    (["packed", "--seq_len", "128"], "unrecognized arguments: --seq_len 128"),
    (["sft", "--batch_size", "8"], "unrecognized arguments: --batch_size 8"),
])
def test_train_bench_declares_its_subcommands_and_refuses_old_flags(argv, message, capsys):
  assert _exit_status(train_bench.main, argv) == 2
  assert message in capsys.readouterr().err


def test_segpack_stats_on_the_small_builtin_corpus(tmp_path):
  """`python -m segpack stats --data builtin:small --seq-len 512` in a fresh process (the corpus
  is built into a temporary cache first, a few seconds): its figures agree with the shards."""
  env = dict(os.environ, SEGPACK_CACHE=str(tmp_path / "cache"))
  proc = subprocess.run(
      [sys.executable, "-m", "segpack", "stats", "--data", "builtin:small", "--seq-len", "512"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  lengths = np.asarray(ShardSource(
      corpus.ensure_builtin(size="small", cache_dir=tmp_path / "cache").train_dir).lengths)

  def figure(name: str) -> float:
    match = re.search(rf"^\s+{name}\s+([\d,.]+)", proc.stdout, re.M)
    assert match, (name, proc.stdout)
    return float(match.group(1).replace(",", ""))

  assert proc.stdout.startswith("strategy ffd, seq_len 512\n")
  assert figure("documents") == len(lengths)
  # Every token goes in (no document is dropped), with BOS and EOS added.
  assert figure("dropped documents") == 0
  assert figure("tokens \\(slots used\\)") >= lengths.sum() + 2 * len(lengths)
  assert figure("slots") == figure("rows") * 512
  assert figure("rows") >= math.ceil(figure("tokens \\(slots used\\)") / 512)
  assert figure("utilization") == pytest.approx(
      100 * figure("tokens \\(slots used\\)") / figure("slots"), abs=1e-3)

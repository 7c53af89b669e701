"""Every command ends a user error with one line naming the argument and its value (exit status
2) and an internal error with its traceback and a line asking to report it (exit status 1), through
one shared wrapper (`segpack.errors.command`)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from segpack.bench import attention as bench_attention
from segpack.bench import gpu_report as bench_gpu_report
from segpack.bench import packing as bench_packing
from segpack.bench import verify as bench_verify
from segpack import errors
from segpack.cli import main as cli_main
from segpack.cli import stats as stats_cli
from segpack.cli import tokenize as tokenize_cli
from segpack.shards import ShardFormatError
from segpack.text.tokenizers import spm
from train.bench import adapters as bench_adapters
from train.bench import training as train_bench
from train.bench import hf_import as bench_hf_import
from train.bench import memory as bench_memory
from train.bench import revisions as bench_revisions
from train.export import command as train_export
from train.preference import score as train_score
from train.rollout import score as rollout_score
from train import main as train_main
from train import plot as train_plot
from train.sample import bench as sample_bench
from train.sample import command as sample_command
from support import paths

ENTRY_POINTS = {
    "segpack": cli_main.main, "segpack tokenize": tokenize_cli.main,
    "segpack stats": stats_cli.main, "segpack bench packing": bench_packing.main,
    "segpack bench attention": bench_attention.main,
    "segpack bench gpu-report": bench_gpu_report.main,
    "python -m segpack.bench.verify": bench_verify.main, "python -m train.bench": train_bench.main,
    "python -m train.plot": train_plot.main, "python -m train.export": train_export.main,
    "python -m train.bench.hf_import": bench_hf_import.main,
    "python -m train.main": train_main.cli, "python -m train.sample": sample_command.cli,
    "python -m train.sample.bench": sample_bench.main,
    "python -m train.bench.revisions": bench_revisions.main,
    "python -m train.bench.memory": bench_memory.main,
    "python -m train.bench.adapters": bench_adapters.main,
    "python -m train.preference.score": train_score.main,
    "python -m train.rollout.score": rollout_score.main,
}
REPO = str(paths.REPO)


def _commands_in(package: str) -> set[str]:
  """`python -m X` for every module of `package` that runs as a program (a `__main__.py` names
  its package)."""
  out = set()
  for root, _, names in os.walk(os.path.join(REPO, package)):
    for name in names:
      path = os.path.join(root, name)
      if not name.endswith(".py") or (name != "__main__.py" and '__name__ == "__main__"' not in
                                      open(path, encoding="utf-8").read()):
        continue
      dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
      out.add("python -m " + dotted.removesuffix(".__main__"))
  return out


def test_every_train_command_is_an_entry_point():
  """Every `python -m train...` command ends through the shared wrapper (none is left out)."""
  commands = _commands_in("train")
  assert {"python -m train.main", "python -m train.sample", "python -m train.export"} <= commands
  assert commands <= set(ENTRY_POINTS), sorted(commands - set(ENTRY_POINTS))



def _run(main, argv) -> int:
  try:
    return main(argv)
  except SystemExit as e:  # argparse
    return e.code


def test_every_entry_point_goes_through_the_shared_wrapper():
  for prog, main in ENTRY_POINTS.items():
    assert getattr(main, "command_prog", None) == prog, prog


# (entry point, argv, what the last line must hold: the argument and the value)
USER_ERRORS = [
    (train_bench.main, ["gpu-numbers", "--out", "x", "--dry-run", "--only", "train_1b_pakced"],
     ["--only", "train_1b_pakced"]),
    (train_bench.main, ["steps", "--config", "configs/packed.py:smoke", "--set",
                        "train.batch_sizes=4"], ["--set", "train.batch_sizes=4", "batch_size"]),
    (train_bench.main, ["steps", "--config", "configs/nope.py"], ["--config", "configs/nope.py"]),
    (train_plot.main, ["/no/such/run"], ["workdir", "/no/such/run"]),
    (train_export.main, ["--workdir", "/no/such/run", "--output", "/tmp/x"],
     ["--workdir", "/no/such/run"]),
    (bench_hf_import.main, ["--size-gb", "-1"], ["--size-gb", "-1"]),
    (bench_verify.main, ["--gb", "0"], ["--gb", "'0'"]),
    (bench_verify.main, ["--dir", "/no/such/dir"], ["--dir", "/no/such/dir"]),
    (bench_verify.main, ["--repeats", "-1"], ["--repeats", "'-1'"]),
    (bench_packing.main, ["--strategies", "ffd,nope"], ["--strategies", "nope"]),
    (bench_packing.main, ["--sections", "plan,nope"], ["--sections", "nope"]),
    (bench_packing.main, ["--seq-len", "1"], ["--seq-len", "'1'"]),
    (bench_packing.main, ["--sigma", "nan"], ["--sigma", "'nan'"]),
    (train_bench.main, ["packed", "--docs", "0"], ["--docs", "'0'"]),
    (train_bench.main, ["sft", "--examples-per-batch", "0"], ["--examples-per-batch", "'0'"]),
    (bench_gpu_report.main, ["--jobs", "0"], ["--jobs", "'0'"]),
    (bench_adapters.main, ["--steps", "0"], ["--steps", "'0'"]),
    (cli_main.main, ["bench", "packing", "--batch-size", "0"], ["--batch-size", "'0'"]),
    (train_score.main, ["--workdir", "w", "--data", "d", "--output", "o", "--batch-size", "0"],
     ["--batch-size", "'0'"]),
    (train_score.main, ["--workdir", "w", "--data", "d", "--output", "o", "--seq-len", "0"],
     ["--seq-len", "'0'"]),
    (rollout_score.main, ["--workdir", "w", "--completions", "c", "--output", "o",
                          "--batch-size", "0"], ["--batch-size", "'0'"]),
    (rollout_score.main, ["--workdir", "w", "--completions", "c", "--output", "o",
                          "--temperature", "0"], ["--temperature", "'0'"]),
]


@pytest.mark.parametrize("main,argv,want", USER_ERRORS,
                         ids=[f"{m.command_prog} {' '.join(a)}" for m, a, _ in USER_ERRORS])
def test_a_user_error_ends_with_one_line_naming_argument_and_value(main, argv, want, capsys):
  assert _run(main, argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert "Traceback" not in "\n".join(err), err
  assert err[-1].startswith(f"{main.command_prog}") and ": error: " in err[-1], err
  assert all(w in err[-1] for w in want), err
  assert not err[:-1] or err[0].startswith("usage: "), err  # argparse's usage line only


def test_an_unreadable_file_is_a_user_error(tmp_path, capsys):
  (tmp_path / "metrics.jsonl").mkdir()  # a directory where a file belongs
  assert train_plot.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "metrics.jsonl" in err[0], err


def test_an_internal_error_shows_its_traceback_and_asks_for_a_report(monkeypatch, capsys):
  def broken(*args, **kwargs):
    raise ValueError("operands could not be broadcast together")  # a bug, not bad input

  monkeypatch.setattr(bench_verify, "measure", broken)
  assert bench_verify.main(["--gb", "0.001"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err[0].startswith("Traceback") and any("broadcast" in line for line in err), err
  assert err[-1] == ("python -m segpack.bench.verify: internal error, please report it with the "
                     "traceback above"), err


def test_user_errors_are_the_projects_own_classes_and_os_errors():
  assert errors.is_user_error(ShardFormatError("x"))
  assert errors.is_user_error(FileNotFoundError(2, "No such file", "x"))
  assert errors.is_user_error(errors.UsageError("x"))
  assert not errors.is_user_error(ValueError("x"))
  assert not errors.is_user_error(TypeError("x"))
  assert not errors.is_user_error(KeyError("x"))


# Exceptions of the project that are not a user's mistake: a leak the attention self-check
# found (a bug), a run stopped by a signal (not an error), a reader's private signal.
NOT_USER_ERRORS = {"AttentionLeakError", "RunStopped", "_CorruptStream"}


_SCAN = """
import importlib, json, os, pkgutil, sys
from segpack import errors
found = {}
for package in ("segpack", "train", "configs"):
  for info in pkgutil.walk_packages([os.path.join(sys.argv[1], package)], prefix=package + "."):
    if info.name.endswith("__main__") or info.name == "train.main":
      continue  # running them parses flags
    module = importlib.import_module(info.name)
    for name, value in vars(module).items():
      if (isinstance(value, type) and issubclass(value, BaseException)
          and value.__module__ == module.__name__):
        found[f"{module.__name__}.{name}"] = issubclass(value, errors.UserError)
print(json.dumps(found))
"""


def test_every_project_error_class_derives_from_user_error():
  """One base, no hand list: each exception class the project defines is a `UserError` (or one
  of the few that are not a user's mistake). Scanned in a child process: importing every module
  here would change the logging of the tests that follow."""
  repo = str(paths.REPO)
  proc = subprocess.run([sys.executable, "-c", _SCAN, repo], cwd=repo, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  found = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(found) > 30, sorted(found)
  bad = sorted(n for n, user in found.items()
               if not user and n.rpartition(".")[2] not in NOT_USER_ERRORS)
  assert not bad, bad
  assert {n.rpartition(".")[2] for n in found} >= NOT_USER_ERRORS  # the list is not stale


def test_a_bare_value_error_from_project_code_is_a_bug_not_a_user_error():
  """No frame inspection: where a ValueError was raised says nothing; its class does."""
  try:
    raise ValueError("raised by the project's own code")
  except ValueError as e:
    assert not errors.is_user_error(e)
  assert errors.is_user_error(errors.ArgumentError("x"))
  assert isinstance(errors.ArgumentError("x"), ValueError)
  assert isinstance(errors.ArgumentTypeError("x"), TypeError)


def test_tokenize_and_stats_tell_a_library_bug_from_a_projects_own_check(monkeypatch, tmp_path,
                                                                         capsys):
  """A bare ValueError raised inside NumPy is a bug (traceback, exit 1); one raised by a check of
  segpack's own code names the problem in one line (exit 2)."""
  def numpy_bug(*args, **kwargs):
    return np.zeros(3).reshape(4)

  def own_check(*args, **kwargs):
    return spm.train_spm([""], tmp_path / "m.model", vocab_size=1000)  # no text: bare ValueError

  argv = ["--input", str(tmp_path), "--output", str(tmp_path / "out")]
  monkeypatch.setattr(tokenize_cli, "tokenize_files", numpy_bug)
  assert tokenize_cli.main(argv) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err[0].startswith("Traceback") and "reshape" in "\n".join(err), err
  assert err[-1].startswith("segpack tokenize: internal error, please report it"), err
  monkeypatch.setattr(tokenize_cli, "tokenize_files", own_check)
  assert tokenize_cli.main(argv) == 2
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and "no non-blank text to train" in err[0], err
  monkeypatch.setattr(stats_cli.packing, "plan", numpy_bug)
  np.save(tmp_path / "l.npy", np.array([3, 5, 7]))
  assert stats_cli.main(["--data", str(tmp_path / "l.npy"), "--seq-len", "8"]) == 1
  assert "internal error, please report it" in capsys.readouterr().err

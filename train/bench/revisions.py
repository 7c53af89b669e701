"""Two revisions side by side in one run: `python -m train.bench.revisions --before REV`.

`... --before e083c31 [--after HEAD] [--repeats N] [--json] [--only train,dpo,lora]` checks
out both revisions of this module's repository and runs the same workloads in each, to show that
a change left every result as it was:

- `corpus`: the small built-in corpus, tokenized once into each checkout's own cache
  (`$SEGPACK_CACHE`; the shard format may differ between revisions, so none is shared): the
  sha256 of its shard files and of its SentencePiece model.
- `packing`: `python -m segpack.bench.packing --json` (`PACKING_FLAGS`: every section but
  `scale`): each result row, every field but the measured ones.
- `train`: `python -m train.main --config=configs/packed.py:smoke` for `TRAIN_STEPS` steps: the
  per-step batch fingerprints (`WORKDIR/batches*.jsonl`), every record of
  `WORKDIR/metrics.jsonl` and the sha256 of every parameter array of the final checkpoint
  (read back by `train.runs.loaded.load_run`).
- `bench`: `python -m train.bench packed --json` (`BENCH_FLAGS`): the documents, and the steps,
  tokens, utilization and final loss of the packed and the padded run.
- `dpo`: preference pairs (`write_inputs`: one JSONL file both checkouts read) through
  `segpack tokenize --format preference` with the checkout's built-in SentencePiece model, then
  `python -m train.main --config=configs/dpo.py:smoke` for `TUNE_STEPS` steps: the dataset's
  files' sha256, and the batches, metrics and final parameters as for `train`.
- `lora`: chat conversations (the same way) through `segpack tokenize --format chat`, SFT from
  scratch on them (`configs/sft.py:smoke`), the run exported (`python -m train.export`), the
  chats tokenized again with the export's tokenizer, and LoRA on the export
  (`model.init_from`, `model.lora.rank=8`): the datasets' and the export's files' sha256 (paths
  of the checkout written as names), and the LoRA run's batches, metrics and parameters.

Measured fields (times, rates, RSS and their ratios: `train.bench.compare.MEASURED`) are left
out of the comparison and reported side by side instead; floats are compared bit for bit. Two
formats that changed by design are read alike: a row-stream position logged as `{"epoch",
"index", "rows_per_epoch"}` is the state `{"version": 1, "unit": "rows", "epoch", "index",
"epoch_length"}` of `segpack.data.position`, and `LABEL_RENAMES` gives a benchmark row's new name
for its old one.

Algorithm:
  1. Resolve `--before` and `--after` to commits (`git rev-parse --verify REV^{commit}`); a name
     git does not know ends the command with one line (exit status 2) before anything is made.
  2. Check each out with `git worktree add --detach` into one temporary directory.
  3. Write the `dpo` and `lora` workloads' inputs once; in each checkout, build the corpus (once)
     and record its digests.
  4. For each repeat and workload, run the workload in both checkouts, before first in the 1st,
     3rd, ... repeat and after first in the others (so machine load hits both alike): a
     subprocess with cwd the checkout and `PYTHONPATH` the checkout, timed by its wall clock.
  5. Reduce each run to its parts (what it compares) and its times; every run of a workload, of
     both revisions and every repeat, must compare equal to the first run of `--before`.
  6. Print a table (or JSON): per workload and per part, what was compared, whether it is
     identical (else the first differing field), the median seconds before and after and their
     ratio. Exit status 1 when anything differs.
  7. Remove the worktrees and the temporary directory, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence

from segpack import errors
from train.bench.compare import Run, format_table, table_rows
from train.bench.revision_workloads import (Checkout, WorkloadError, run_workload,
                                            write_inputs)

PROG = "python -m train.bench.revisions"
MODULE_DIR = pathlib.Path(__file__).resolve().parent
WORKLOADS = ("packing", "train", "bench", "dpo", "lora")


class RevisionError(errors.UserError, ValueError):
  """A revision that git does not resolve to a commit of this repository."""


def _git(repo: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=False)


def repository() -> str:
  """The top directory of the git repository this module sits in."""
  done = _git(str(MODULE_DIR), "rev-parse", "--show-toplevel")
  if done.returncode != 0:
    raise RevisionError(f"{MODULE_DIR} is not inside a git repository: {done.stderr.strip()}")
  return done.stdout.strip()


def resolve(repo: str, flag: str, revision: str) -> str:
  """The commit `revision` names in `repo`; raises RevisionError naming `flag` and the value."""
  done = _git(repo, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
  if revision.startswith("-") or done.returncode != 0:
    raise RevisionError(f"{flag} {revision!r} names no commit of {repo}")
  return done.stdout.strip()


@contextlib.contextmanager
def checkouts(repo: str, commits: dict[str, tuple[str, str]]) -> Iterator[list[Checkout]]:
  """Worktrees of `commits` (label -> (revision, commit)) under one temporary directory, each
  with its own cache and scratch directory, and the inputs both read (`write_inputs`); all
  removed on leaving, on an error or Ctrl-C too."""
  root = tempfile.mkdtemp(prefix="bench-revisions-")
  made = []
  try:
    inputs = os.path.join(root, "inputs")
    os.makedirs(inputs)
    write_inputs(inputs)
    out = []
    for label, (revision, commit) in commits.items():
      path = os.path.join(root, label)
      made.append(path)
      done = _git(repo, "worktree", "add", "--detach", path, commit)
      if done.returncode != 0:
        raise WorkloadError(f"git worktree add {path} {commit}: {done.stderr.strip()}")
      dirs = [os.path.join(root, f"{label}-{kind}") for kind in ("cache", "scratch")]
      for d in dirs:
        os.makedirs(d)
      out.append(Checkout(label, revision, commit, path, *dirs, inputs))
    yield out
  finally:
    for path in made:
      _git(repo, "worktree", "remove", "--force", path)
    shutil.rmtree(root, ignore_errors=True)
    _git(repo, "worktree", "prune")


def measure(pair: list[Checkout], *, repeats: int, workloads: Sequence[str]
            ) -> dict[str, list[tuple[str, int, Run]]]:
  """Runs the corpus once per checkout, then every workload `repeats` times in both checkouts,
  alternating which goes first; returns workload -> [(label, repeat, run)] in run order."""
  runs: dict[str, list[tuple[str, int, Run]]] = {name: [] for name in ("corpus", *workloads)}
  for repeat in range(repeats):
    order = pair if repeat % 2 == 0 else pair[::-1]
    for name in (["corpus"] if repeat == 0 else []) + list(workloads):
      for checkout in order:
        run = run_workload(name, checkout)
        runs[name].append((checkout.label, repeat, run))
        print(f"{PROG}: repeat {repeat + 1}/{repeats}, {name}, {checkout.label}: "
              f"{run.wall:.1f} s", file=sys.stderr, flush=True)
  return runs


def _workloads(text: str) -> tuple[str, ...]:
  names = tuple(name for name in text.split(",") if name)
  unknown = [name for name in names if name not in WORKLOADS]
  if unknown or not names:
    raise argparse.ArgumentTypeError(f"expected names of {','.join(WORKLOADS)}, got {text!r}")
  return names


def build_parser() -> argparse.ArgumentParser:
  """The command's flags."""
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--before", required=True, help="revision before the change (git name)")
  parser.add_argument("--after", default="HEAD", help="revision after the change (git name)")
  parser.add_argument("--repeats", type=errors.at_least(1), default=2,
                      help="runs of each workload per revision, alternating which goes first")
  parser.add_argument("--only", type=_workloads, default=WORKLOADS,
                      help=f"comma-separated workloads to run of {','.join(WORKLOADS)} "
                           "(the corpus always runs)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  return parser


@errors.command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
  """Runs the comparison; returns 0 when everything compared is identical, else 1."""
  args = build_parser().parse_args(argv)
  repo = repository()
  commits = {label: (rev, resolve(repo, f"--{label}", rev))
             for label, rev in (("before", args.before), ("after", args.after))}
  with checkouts(repo, commits) as pair:
    rows = table_rows(measure(pair, repeats=args.repeats, workloads=args.only))
  identical = all(r["identical"] is not False for r in rows)
  if args.json:
    print(json.dumps({"before": {"revision": args.before, "commit": commits["before"][1]},
                      "after": {"revision": args.after, "commit": commits["after"][1]},
                      "repeats": args.repeats, "identical": identical, "rows": rows}))
  else:
    print(f"before {args.before} ({commits['before'][1][:10]}), after {args.after} "
          f"({commits['after'][1][:10]}), median of {args.repeats} alternating runs\n"
          + format_table(rows))
    print("identical" if identical else "DIFFERENT: see the first differences above")
  return 0 if identical else 1


if __name__ == "__main__":
  sys.exit(main())

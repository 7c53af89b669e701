"""Two revisions side by side in one run: `python -m train.bench.revisions --before REV`.

`... --before e083c31 [--after HEAD] [--repeats N] [--json] [--only packing,train,bench]` checks
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
  3. In each checkout, build the corpus (once) and record its digests.
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
import dataclasses
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from segpack import errors
from train.bench.compare import Run, comparable, format_table, stream_position, table_rows

PROG = "python -m train.bench.revisions"
MODULE_DIR = pathlib.Path(__file__).resolve().parent
PACKING_FLAGS = ("--json", "--sections", "plan,grain,load,builtin,balance,repack,mixture",
                 "--num-docs", "1000000", "--repeats", "3", "--grain-docs", "10000",
                 "--load-docs", "10000", "--load-batches", "200", "--builtin", "small",
                 "--balance-docs", "200000", "--repack-docs", "1000000",
                 "--mixture-docs", "1000000", "--mixture-grain-docs", "2000")
TRAIN_STEPS = 20
BENCH_FLAGS = ("packed", "--json", "--size", "small", "--docs", "24", "--seq-len", "256",
               "--batch-size", "8")
WORKLOADS = ("packing", "train", "bench")

# Run inside a checkout: the digests of its built-in corpus, and where segpack came from.
CORPUS_PROBE = """
import hashlib, json, pathlib, segpack
from segpack.text import corpus
built = corpus.ensure_builtin(size="small")
root = pathlib.Path(built.train_dir).parent
names = sorted(p for p in root.rglob("*") if p.suffix in (".tokens", ".offsets", ".model"))
print(json.dumps({"segpack": segpack.__file__, "vocab_size": int(built.vocab_size),
                  "files": {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                            for p in names}}))
"""
# Run inside a checkout with a workdir: the sha256 of each parameter array of its last checkpoint.
PARAMS_PROBE = """
import hashlib, importlib, importlib.util, json, sys
import jax, numpy as np
from flax import nnx
def _reader():  # train/runs/loaded.py, train/runs/saved.py and train/saved_run.py before it
  for name in ("train.runs.loaded", "train.runs.saved", "train.saved_run"):
    try:
      if importlib.util.find_spec(name):
        return importlib.import_module(name)
    except ModuleNotFoundError:  # its package is absent in that revision
      continue
_, model, step = _reader().load_run(sys.argv[1])
leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
print(json.dumps({"step": step, "arrays": {
    jax.tree_util.keystr(path): f"{np.asarray(x).dtype}{list(np.shape(x))} "
    + hashlib.sha256(np.asarray(x).tobytes()).hexdigest() for path, x in leaves}}))
"""


class RevisionError(errors.UserError, ValueError):
  """A revision that git does not resolve to a commit of this repository."""


class WorkloadError(errors.UserError, RuntimeError):
  """A workload failed in one checkout (a revision that cannot run it; its stderr's end shown)."""


@dataclasses.dataclass(frozen=True)
class Checkout:
  """One revision checked out: `label` ("before" / "after"), its own cache and scratch space."""
  label: str
  revision: str
  commit: str
  path: str
  cache: str
  scratch: str


def _json_line(stdout: str) -> dict[str, Any]:
  """The JSON object `stdout` ends with: all of it (indented), or its last `{` line."""
  with contextlib.suppress(ValueError):
    return json.loads(stdout)
  lines = [line for line in stdout.splitlines() if line.startswith("{")]
  return json.loads(lines[-1]) if lines else {}


def _jsonl(path: str) -> list[dict[str, Any]]:
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line]


def run_python(checkout: Checkout, args: Sequence[str], *, what: str) -> str:
  """Runs `python ARGS` in `checkout` (cwd and PYTHONPATH, its cache); returns its stdout.

  Raises:
    WorkloadError: the process exited with a status other than 0 (its stderr's end printed).
  """
  env = dict(os.environ, PYTHONPATH=checkout.path, SEGPACK_CACHE=checkout.cache)
  done = subprocess.run([sys.executable, *args], cwd=checkout.path, env=env, text=True,
                        capture_output=True, check=False)
  if done.returncode != 0:
    sys.stderr.write(done.stderr[-6000:])
    raise WorkloadError(f"{what} failed in --{checkout.label} {checkout.revision} "
                        f"({checkout.commit[:10]}) with exit status {done.returncode}")
  return done.stdout


def _corpus(checkout: Checkout, _: str) -> Run:
  probe = json.loads(run_python(checkout, ["-c", CORPUS_PROBE], what="the built-in corpus"))
  if not pathlib.Path(probe["segpack"]).resolve().is_relative_to(
      pathlib.Path(checkout.path).resolve()):
    raise WorkloadError(f"--{checkout.label}: segpack was imported from {probe['segpack']}, "
                        f"not from the checkout {checkout.path}")
  files = probe["files"]
  return Run(parts={"shard and tokenizer sha256": {"vocab_size": probe["vocab_size"], **files}},
             times={}, what=f"small built-in corpus: {len(files)} files' sha256")


def _packing(checkout: Checkout, workdir: str) -> Run:
  out = run_python(checkout, ["-m", "segpack.bench.packing", *PACKING_FLAGS,
                              "--work-dir", workdir], what="segpack.bench.packing")
  parts, times = {}, {}
  for row in _json_line(out).get("results", []):
    label = comparable(f"{row.get('section')}: {row.get('case')}, {row.get('data')}")
    parts[label] = comparable(row)
    if isinstance(row.get("seconds"), (int, float)):
      times[label] = float(row["seconds"])
  return Run(parts=parts, times=times,
             what=f"{len(parts)} result rows: every field but times and RSS")


def _train(checkout: Checkout, workdir: str) -> Run:
  run_python(checkout, ["-m", "train.main", "--config=configs/packed.py:smoke",
                        f"--workdir={workdir}", f"--config.train.num_steps={TRAIN_STEPS}",
                        "--config.train.log_every=1", "--config.train.log_batches=True"],
             what="train.main")
  batches = []
  for path in sorted(glob.glob(os.path.join(workdir, "batches*.jsonl"))):
    for record in _jsonl(path):
      if isinstance(record.get("position"), dict):
        record["position"] = stream_position(record["position"])
      batches.append(comparable(record))
  records = _jsonl(os.path.join(workdir, "metrics.jsonl"))
  metrics = [comparable({k: v for k, v in r.items() if k != "workdir"}) for r in records]
  params = _json_line(run_python(checkout, ["-c", PARAMS_PROBE, workdir],
                                 what="reading the final checkpoint"))
  summary = next((r for r in records if r.get("kind") == "summary"), {})
  times = {"trainer's wall_s": float(summary["wall_s"])} if "wall_s" in summary else {}
  return Run(parts={"batch fingerprints": batches, "metrics (loss, eval loss, ...)": metrics,
                    "final parameters": params}, times=times,
             what=(f"{len(batches)} steps' batch fingerprints, {len(metrics)} metric records, "
                   f"{len(params.get('arrays', {}))} parameter arrays (bit for bit)"))


def _bench(checkout: Checkout, _: str) -> Run:
  result = _json_line(run_python(checkout, ["-m", "train.bench", *BENCH_FLAGS],
                                 what="train.bench packed"))
  parts: dict[str, Any] = {name: {} for name in ("documents", "packed", "padded")}
  for key, value in comparable(result).items():
    name = key.split("_", 1)[0]
    parts[name if name in parts else "documents"][key] = value
  times = {name: float(result[f"{name}_wall_s"]) for name in ("packed", "padded")
           if f"{name}_wall_s" in result}
  return Run(parts=parts, times=times,
             what="steps, real tokens, utilization, final loss of packed and padded")


WORKLOAD_RUNS: dict[str, Callable[[Checkout, str], Run]] = {
    "corpus": _corpus, "packing": _packing, "train": _train, "bench": _bench}


def run_workload(name: str, checkout: Checkout) -> Run:
  """Runs workload `name` in `checkout` in a fresh scratch directory; times the whole of it."""
  workdir = tempfile.mkdtemp(prefix=f"{name}-", dir=checkout.scratch)
  started = time.perf_counter()
  run = WORKLOAD_RUNS[name](checkout, workdir)
  run.wall = time.perf_counter() - started
  shutil.rmtree(workdir, ignore_errors=True)
  return run


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
  with its own cache and scratch directory; all removed on leaving, on an error or Ctrl-C too."""
  root = tempfile.mkdtemp(prefix="bench-revisions-")
  made = []
  try:
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
      out.append(Checkout(label, revision, commit, path, *dirs))
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

"""`segpack bench tokenize`: `segpack tokenize` against the tokenizer alone; where its time goes.

Also `python -m segpack.bench.tokenize` (the same flags). Prints a table, or JSON with `--json`.

The text is `--mb` MB (default 240) of Python's standard-library sources as JSONL, and the
tokenizers a SentencePiece model and a byte-level BPE `tokenizer.json` of `--vocab-size` pieces
trained on them (`segpack.bench.tokenize_inputs`; both kept in `--work-dir` for the next run).
For each tokenizer of `--kinds`, `--repeats` times one after the other (the best of each is
reported, and the ratios are of those bests, measured side by side):

- `alone`: the tokenizer's batch call on the texts in memory, in `--workers` processes
  (`tokenize_inputs.alone`): SentencePiece's `encode(texts)` with its ids as lists, Hugging
  Face's `encode_batch`; `alone_numpy` (SentencePiece 0.2.1 and later): `encode(texts,
  return_type="numpy")`, the faster call that segpack's workers make;
- `segpack`: `python -m segpack tokenize --input FILE --output DIR --spm-model M` (or
  `--tokenizer hf:T`) with its default settings and `--no-progress`, timed from outside, start-up
  included: reading, encoding, writing shards, checksums and manifest. Its summary says how long
  its main process spent reading (cutting the input into parts, when its workers read them),
  encoding (waiting for its workers), writing and hashing; `other` is the rest: start-up,
  starting the workers, the summary. `worker_read` and `worker_encode` are its workers' seconds
  reading and encoding, summed over the workers;
- `before` (unless `--no-baseline`): the same command as it ran before it wrote whole chunks
  (`python -m segpack.cli.tokenize_baseline`, the same flags); its output directory is
  compared with segpack's file by file (`same_bytes`).

Throughput is text MB (of the JSONL file) and tokens per second; `of_alone` is the alone
seconds over the path's seconds (1.0: the tokenizer's own throughput), `of_fastest_alone` the
same against `alone_numpy` where there is one. `cpu_seconds`: for `alone`, the processes' CPU
seconds while they encode; for a run, its processes' (workers included; not the forkserver
process that `segpack tokenize` forks its workers from, about 0.2 s to start). `--workers`
(default: the CPUs) sets the processes of `alone`, and is passed to `segpack tokenize` only
when given.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import multiprocessing
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import segpack
from segpack.bench import tokenize_inputs
from segpack import errors
from segpack.text import encode
from segpack.text.tokenizers import spm as spm_lib
from segpack.text.dataset import LOCK_NAME

__all__ = ["PATHS", "format_table", "main", "run_tokenize", "same_bytes"]

# The paths measured for each tokenizer, in the table's order (`alone_numpy`: SentencePiece only).
PATHS = ("alone", "alone_numpy", "segpack", "before")
_STAGE_LINE = re.compile(r"time by stage\s+(.*)")
# `segpack tokenize` forks its workers from a server process where the system has one.
_FORKSERVER = "forkserver" in multiprocessing.get_all_start_methods()
_STAGE = re.compile(r"(\w+) ([0-9.]+) s")
_COLUMNS = (("tokenizer", "{}", 9), ("path", "{}", 11), ("seconds", "{:.2f}", 8),
            ("cpu_seconds", "{:.1f}", 11), ("mb_per_s", "{:.1f}", 8),
            ("m_tokens_per_s", "{:.2f}", 14), ("of_alone", "{:.1%}", 8), ("read", "{:.2f}", 6),
            ("encode", "{:.2f}", 6), ("write", "{:.2f}", 6), ("hash", "{:.2f}", 6),
            ("other", "{:.2f}", 6), ("worker_read", "{:.1f}", 11),
            ("worker_encode", "{:.1f}", 13), ("same_bytes", "{}", 10))


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def _environment(work_dir: Path) -> dict[str, str]:
  """The subprocesses' environment: this segpack first on the path, a verification cache of
  their own in the work directory."""
  root = str(Path(segpack.__file__).resolve().parents[1])
  path = os.environ.get("PYTHONPATH")
  return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""),
              SEGPACK_CACHE=str(work_dir / "cache"))


def _tokenizer_flags(kind: str, tokenizer_file: str) -> list[str]:
  return ["--spm-model", tokenizer_file] if kind == "spm" else ["--tokenizer",
                                                                f"hf:{tokenizer_file}"]


def run_tokenize(path: str, kind: str, tokenizer_file: str, corpus: str, output: Path, *,
                 workers: int | None, env: dict[str, str]) -> dict[str, Any]:
  """One `segpack tokenize` run (`path` "segpack") or one of its baseline ("before") into an
  empty `output`: seconds from outside, CPU seconds of its processes, its stage seconds."""
  module = "segpack" if path == "segpack" else "segpack.cli.tokenize_baseline"
  command = [sys.executable, "-m", module] + (["tokenize"] if path == "segpack" else [])
  command += ["--input", corpus, "--output", str(output), "--no-progress",
              *_tokenizer_flags(kind, tokenizer_file)]
  if workers is not None:
    command += ["--workers", str(workers)]
  shutil.rmtree(output, ignore_errors=True)
  cpu, started = _children_cpu(), time.perf_counter()
  done = subprocess.run(command, env=env, capture_output=True, text=True)
  seconds, cpu = time.perf_counter() - started, _children_cpu() - cpu
  if done.returncode != 0:
    raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}): {done.stderr}")
  found = _STAGE_LINE.search(done.stdout)
  stages = {k: float(v) for k, v in _STAGE.findall(found.group(1))} if found else None
  if stages and path == "segpack" and _FORKSERVER:
    cpu += stages.get("worker_cpu", 0.0)  # its workers are the forkserver's children, not its
  return {"seconds": seconds, "cpu_seconds": cpu, "stages": stages}


def _alone(kind: str, tokenizer_file: str, corpus: str, *, workers: int, numpy_ids: bool,
           env: dict[str, str]) -> dict[str, Any]:
  """`tokenize_inputs.alone` in a fresh process (nothing of this one is inherited)."""
  code = ("import json, sys; from segpack.bench.tokenize_inputs import alone; "
          "print(json.dumps(alone(sys.argv[1], sys.argv[2], sys.argv[3], procs=int(sys.argv[4]), "
          "numpy_ids=sys.argv[5] == '1')))")
  done = subprocess.run([sys.executable, "-c", code, kind, tokenizer_file, corpus, str(workers),
                         str(int(numpy_ids))], env=env, capture_output=True, text=True,
                        check=True)
  return json.loads(done.stdout.strip().splitlines()[-1])


def same_bytes(a: Path, b: Path) -> bool:
  """Whether directories `a` and `b` hold the same file names with the same bytes (the lock
  file of the run that wrote them aside: it names that process)."""
  names = sorted(p.name for p in Path(a).iterdir() if p.name != LOCK_NAME)
  if names != sorted(p.name for p in Path(b).iterdir() if p.name != LOCK_NAME):
    return False
  return all(filecmp.cmp(Path(a) / n, Path(b) / n, shallow=False) for n in names)


def _tokens(output: Path) -> int:
  return int(json.loads((output / "manifest.json").read_text("utf-8"))["num_tokens"])


def bench_kind(kind: str, tokenizer_file: str, corpus: dict[str, Any], *, work_dir: Path,
               repeats: int, workers: int, pass_workers: bool,
               baseline: bool) -> list[dict[str, Any]]:
  """The rows of one tokenizer: each path's best of `repeats`, the paths run in turn."""
  env = _environment(work_dir)
  paths = [p for p in PATHS if (baseline or p != "before")
           and (p != "alone_numpy" or (kind == "spm" and spm_lib.NUMPY_IDS))]
  runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
  outputs = {p: work_dir / f"out-{kind}-{p}" for p in paths if not p.startswith("alone")}
  for _ in range(repeats):
    for p in paths:
      if p.startswith("alone"):
        runs[p].append(_alone(kind, tokenizer_file, corpus["path"], workers=workers,
                              numpy_ids=p == "alone_numpy", env=env))
      else:
        runs[p].append(run_tokenize(p, kind, tokenizer_file, corpus["path"], outputs[p],
                                    workers=workers if pass_workers else None, env=env))
  tokens = _tokens(outputs["segpack"])
  same = same_bytes(outputs["segpack"], outputs["before"]) if baseline else None
  rows = []
  for p in paths:
    best = min(runs[p], key=lambda r: r["seconds"])
    row = {"tokenizer": kind, "path": p, "seconds": best["seconds"],
           "cpu_seconds": best["cpu_seconds"], "samples": [r["seconds"] for r in runs[p]],
           "mb_per_s": corpus["bytes"] / 1e6 / best["seconds"],
           "m_tokens_per_s": tokens / 1e6 / best["seconds"], "tokens": tokens,
           "workers": workers}
    if p.startswith("alone"):
      row.update(call=best["call"], alone_tokens=best["tokens"])
    if best.get("stages"):
      row.update(best["stages"])
      row["other"] = best["seconds"] - sum(best["stages"].get(k, 0.0) for k in encode.STAGES)
    if p == "segpack" and same is not None:
      row["same_bytes"] = "yes" if same else "NO"
    rows.append(row)
  fastest = rows[1] if len(paths) > 1 and paths[1] == "alone_numpy" else rows[0]
  for row in rows:
    row["of_alone"] = rows[0]["seconds"] / row["seconds"]
    row["of_fastest_alone"] = fastest["seconds"] / row["seconds"]
  for output in outputs.values():
    shutil.rmtree(output, ignore_errors=True)
  return rows


def format_table(results: list[dict[str, Any]], corpus: dict[str, Any]) -> str:
  """The rows as a table, then a note on the text and the alone calls."""
  lines = ["".join(f"{name:<{w}} " if i < 2 else f"{name:>{w}} "
                   for i, (name, _, w) in enumerate(_COLUMNS))]
  for r in results:
    cells = [fmt.format(r[name]) if name in r else "-" for name, fmt, _ in _COLUMNS]
    lines.append("".join(f"{c:<{w}} " if i < 2 else f"{c:>{w}} "
                         for i, (c, (_, _, w)) in enumerate(zip(cells, _COLUMNS))))
  lines.append(f"text: {corpus['bytes'] / 1e6:,.1f} MB of JSONL, {corpus['documents']:,} "
               f"documents ({corpus['passes']:.2f} passes over {corpus['source_files']:,} "
               f"standard-library sources); best of {len(results[0]['samples'])} runs each")
  for r in results:
    if r["path"].startswith("alone"):
      lines.append(f"{r['tokenizer']} {r['path']}: {r['call']} in {r['workers']} processes, "
                   f"batches of about 1 MB")
    if r["path"] == "segpack" and r["of_fastest_alone"] != r["of_alone"]:
      lines.append(f"{r['tokenizer']} segpack: {r['of_fastest_alone']:.1%} of alone_numpy's "
                   f"throughput (its workers make that call)")
  return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="segpack bench tokenize", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--mb", type=errors.at_least(0.001, float), default=240.0,
                  help="MB of JSONL text (default 240)")
  ap.add_argument("--kinds", default="spm,hf", help="tokenizers: spm, hf or both (default)")
  ap.add_argument("--vocab-size", type=errors.at_least(300), default=8000)
  ap.add_argument("--repeats", type=errors.at_least(1), default=3)
  ap.add_argument("--workers", type=errors.at_least(1), default=None,
                  help="processes (default: the CPUs); passed to segpack tokenize when given")
  ap.add_argument("--work-dir", default=None,
                  help="keeps the text and the tokenizers for the next run (default: a "
                       "temporary directory, removed)")
  ap.add_argument("--no-baseline", action="store_true", help="skip the `before` runs")
  ap.add_argument("--json", action="store_true")
  return ap


@errors.command("segpack bench tokenize")
def main(argv: Sequence[str] | None = None) -> int:
  """Runs the benchmark; prints the table (or JSON with `--json`)."""
  args = _parser().parse_args(argv)
  kinds = [k for k in args.kinds.split(",") if k]
  if not kinds or not set(kinds) <= set(tokenize_inputs.KINDS):
    raise errors.UsageError(f"--kinds {args.kinds!r}: expected some of "
                            f"{', '.join(tokenize_inputs.KINDS)}, comma-separated")
  temporary = args.work_dir is None
  work_dir = Path(tempfile.mkdtemp(prefix="segpack-bench-tokenize-") if temporary
                  else args.work_dir)
  work_dir.mkdir(parents=True, exist_ok=True)
  try:
    corpus = tokenize_inputs.build_corpus(work_dir, mb=args.mb)
    tokenizers = tokenize_inputs.train_tokenizers(work_dir, vocab_size=args.vocab_size,
                                                  mb=args.mb)
    workers = args.workers or os.cpu_count() or 1
    results = []
    for kind in kinds:
      results += bench_kind(kind, tokenizers[kind], corpus, work_dir=work_dir,
                            repeats=args.repeats, workers=workers,
                            pass_workers=args.workers is not None,
                            baseline=not args.no_baseline)
  finally:
    if temporary:
      shutil.rmtree(work_dir, ignore_errors=True)
  meta = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "corpus": corpus}
  if args.json:
    print(json.dumps({"results": results, **meta}, indent=1))
  else:
    print(format_table(results, corpus))
    print(f"load average {meta['load_average'][0]:.1f} on {meta['cpus']} CPUs")
  return 0


if __name__ == "__main__":
  sys.exit(main())

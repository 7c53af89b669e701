"""The workloads `python -m train.bench.revisions` runs in each checkout (its docstring lists
them) and the parts of each that it compares: `WORKLOAD_RUNS` maps a name to a function of a
`Checkout` and a scratch directory returning a `train.bench.compare.Run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydoc_data import topics as pydoc_topics

from segpack import errors
from train.bench.compare import Run, comparable, stream_position

PACKING_FLAGS = ("--json", "--sections", "plan,grain,load,builtin,balance,repack,mixture",
                 "--num-docs", "1000000", "--repeats", "3", "--grain-docs", "10000",
                 "--load-docs", "10000", "--load-batches", "200", "--builtin", "small",
                 "--balance-docs", "200000", "--repack-docs", "1000000",
                 "--mixture-docs", "1000000", "--mixture-grain-docs", "2000")
TRAIN_STEPS = 20
TUNE_STEPS = 8  # steps of the dpo and lora workloads
INPUT_TOPICS = 96  # pydoc topics the dpo and lora inputs are made of
BENCH_FLAGS = ("packed", "--json", "--size", "small", "--docs", "24", "--seq-len", "256",
               "--batch-size", "8")

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
  inputs: str  # the dpo and lora workloads' inputs, shared by both checkouts


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


def _trained(checkout: Checkout, workdir: str, config: str, *flags: str,
             steps: int) -> dict[str, Any]:
  """Runs `train.main --config=CONFIG FLAGS` for `steps` steps in `checkout`, logging every step
  and batch; returns the parts it compares: the batch fingerprints, the metric records (every
  one but its workdir) and the sha256 of each parameter array of the final checkpoint."""
  run_python(checkout, ["-m", "train.main", f"--config={config}", f"--workdir={workdir}",
                        *flags, f"--config.train.num_steps={steps}",
                        "--config.train.log_every=1", "--config.train.log_batches=True"],
             what=f"train.main --config={config}")
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
  return {"batch fingerprints": batches, "metrics (loss, eval loss, ...)": metrics,
          "final parameters": params, "wall_s": summary.get("wall_s")}


def _run_of(parts: dict[str, Any], **extra: Any) -> Run:
  """A `Run` of `_trained`'s parts (and `extra` parts before them), its trainer's wall time."""
  wall = parts.pop("wall_s")
  return Run(parts={**extra, **parts},
             times={"trainer's wall_s": float(wall)} if wall is not None else {},
             what=(f"{len(parts['batch fingerprints'])} steps' batch fingerprints, "
                   f"{len(parts['metrics (loss, eval loss, ...)'])} metric records, "
                   f"{len(parts['final parameters'].get('arrays', {}))} parameter arrays"
                   + "".join(f", {name}" for name in extra) + " (bit for bit)"))


def _train(checkout: Checkout, workdir: str) -> Run:
  return _run_of(_trained(checkout, workdir, "configs/packed.py:smoke", steps=TRAIN_STEPS))


def write_inputs(directory: str) -> None:
  """Writes the `dpo` and `lora` workloads' inputs into `directory`, once for both checkouts:
  `pairs.jsonl` (a prompt asking about a pydoc topic, that topic's text chosen and the next
  topic's rejected) and `chat.jsonl` (the same question and the topic's text as the answer),
  from the first `INPUT_TOPICS` topics: text every Python install carries."""
  names = sorted(pydoc_topics.topics)[:INPUT_TOPICS]
  texts = [" ".join(pydoc_topics.topics[n].split()[:80]) for n in names]
  pairs, chats = [], []
  for i, name in enumerate(names):
    prompt = f"What does the Python reference say about {name!r}?"
    pairs.append({"prompt": prompt, "chosen": texts[i], "rejected": texts[(i + 1) % len(names)]})
    chats.append({"messages": [{"role": "user", "content": prompt},
                               {"role": "assistant", "content": texts[i]}]})
  for file, records in (("pairs.jsonl", pairs), ("chat.jsonl", chats)):
    pathlib.Path(directory, file).write_text("".join(json.dumps(r) + "\n" for r in records))


def _digests(directory: str, *, paths: dict[str, str]) -> dict[str, str]:
  """The sha256 of every file under `directory` (a dataset, an export) but its locks, and each
  `.json` file's content (compared field by field); in a `.json` file each `paths` value (a
  directory of this checkout or run) is first written as its key, so that where the checkout
  and its scratch space lie does not count."""
  out = {}
  for p in sorted(p for p in pathlib.Path(directory).rglob("*")
                  if p.is_file() and p.suffix != ".lock"):  # a lock says which process held it
    data = p.read_bytes()
    if p.suffix == ".json":
      text = data.decode("utf-8")
      for name, path in sorted(paths.items(), key=lambda kv: -len(kv[1])):
        text = text.replace(path, name)
      with contextlib.suppress(ValueError):  # compared field by field, to name what differs
        content = json.loads(text)
        if isinstance(content, dict):  # a digest of a field compared here (of its raw paths)
          content = {k: v for k, v in content.items()
                     if not (k.endswith("_sha256") and k.removesuffix("_sha256") in content)}
        out[str(p.relative_to(directory))] = content
        continue
      data = text.encode("utf-8")
    out[str(p.relative_to(directory))] = hashlib.sha256(data).hexdigest()
  return out


def _tokenized(checkout: Checkout, workdir: str, *, kind: str, file: str,
               tokenizer: Sequence[str] = (), name: str | None = None) -> tuple[str, dict]:
  """`segpack tokenize --format KIND` of the shared input `file` into WORKDIR/NAME (default
  KIND), with `tokenizer`'s flags (default: the checkout's built-in SentencePiece model);
  returns the dataset's directory and its files' sha256 (`_digests`)."""
  if not tokenizer:
    models = sorted(glob.glob(os.path.join(checkout.cache, "**", "*.model"), recursive=True),
                    key=lambda m: "builtin-small" not in m)  # the corpus workload's model first
    if not models:
      raise WorkloadError(f"--{checkout.label}: no SentencePiece model in {checkout.cache}")
    tokenizer = ("--spm-model", models[0])
  out = os.path.join(workdir, name or kind)
  run_python(checkout, ["-m", "segpack", "tokenize", "--format", kind, "--input",
                        os.path.join(checkout.inputs, file), *tokenizer, "--output", out,
                        "--workers", "1", "--no-progress"],
             what=f"segpack tokenize --format {kind}")
  return out, _digests(out, paths=_places(checkout, workdir))


def _places(checkout: Checkout, workdir: str) -> dict[str, str]:
  """The directories a workload's files may name, by the name `_digests` writes for them."""
  return {"$WORKDIR": workdir, "$CACHE": checkout.cache, "$CHECKOUT": checkout.path,
          "$INPUTS": checkout.inputs}


def _dpo(checkout: Checkout, workdir: str) -> Run:
  data, digests = _tokenized(checkout, workdir, kind="preference", file="pairs.jsonl")
  parts = _trained(checkout, os.path.join(workdir, "run"), "configs/dpo.py:smoke",
                   f"--config.data.train={data}", steps=TUNE_STEPS)
  return _run_of(parts, **{"tokenized pairs' sha256": digests})


def _export_module(checkout: Checkout) -> str:
  """The export command of the checkout: `train.export`, `train.hf.export` before it moved."""
  for module in ("train.export", "train.hf.export"):
    path = pathlib.Path(checkout.path, *module.split("."))
    if path.is_dir() or path.with_suffix(".py").is_file():
      return module
  raise WorkloadError(f"--{checkout.label}: no export command in {checkout.path}")


def _lora(checkout: Checkout, workdir: str) -> Run:
  """The README's adapter path on a model of its own: SFT from scratch on the chats, the run
  exported (`train.export`), the chats tokenized with the export's tokenizer, and LoRA on the
  export (`model.init_from`)."""
  data, digests = _tokenized(checkout, workdir, kind="chat", file="chat.jsonl")
  base = os.path.join(workdir, "base")
  _trained(checkout, base, "configs/sft.py:smoke", f"--config.data.train={data}",
           steps=TUNE_STEPS)
  exported = os.path.join(workdir, "exported")
  run_python(checkout, ["-m", _export_module(checkout), "--workdir", base, "--output", exported],
             what="the export")
  again, hf_digests = _tokenized(checkout, workdir, kind="chat", file="chat.jsonl",
                                 tokenizer=("--tokenizer", f"hf:{exported}"), name="chat-hf")
  parts = _trained(checkout, os.path.join(workdir, "lora"), "configs/sft.py:smoke",
                   f"--config.data.train={again}", f"--config.model.init_from={exported}",
                   "--config.model.lora.rank=8", steps=TUNE_STEPS)
  return _run_of(parts, **{"tokenized chats' sha256": digests,
                           "exported SFT model's sha256": _digests(
                               exported, paths=_places(checkout, workdir)),
                           "chats in its tokenizer's sha256": hf_digests})


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
    "corpus": _corpus, "packing": _packing, "train": _train, "bench": _bench, "dpo": _dpo,
    "lora": _lora}


def run_workload(name: str, checkout: Checkout) -> Run:
  """Runs workload `name` in `checkout` in a fresh scratch directory; times the whole of it."""
  workdir = tempfile.mkdtemp(prefix=f"{name}-", dir=checkout.scratch)
  started = time.perf_counter()
  run = WORKLOAD_RUNS[name](checkout, workdir)
  run.wall = time.perf_counter() - started
  shutil.rmtree(workdir, ignore_errors=True)
  return run

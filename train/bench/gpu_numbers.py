"""Every GPU figure in one command: `python -m train.bench gpu-numbers --out DIR [--dry-run]`.

Runs, one after another, each in its own process with its own time limit, and writes every
figure into ONE JSON file, `DIR/gpu_numbers.json` (rewritten atomically after every stage):

  1. `gpu_report`: `segpack bench gpu-report --quick --no-bench` (correctness grid of every
     backend, forward and gradients, bf16 and f32; cuDNN memory; versions and device).
  2. `attention_longtail_sweep`: `segpack bench attention` at S = 8192 on long-tailed lengths
     (lognormal, sigma 1.5): segpack's Pallas and cuDNN paths, XLA with a dense mask,
     `jax.nn.dot_product_attention` cuDNN with a dense per-document mask, JAX's Pallas `mha`
     with segment ids, Pallas with a dense mask; and segpack's Pallas kernel under the settings
     of `segpack.bench.attention.SWEEP`; at D = 128.
  3. `attention_longtail`: the same at S = 2048 and 32768, without the sweep.
  4. `attention_builtin`: S = 8192, 2048, 32768 on rows packed from the built-in corpus's
     document lengths (the corpus is built meanwhile).
  5. `train_gpu_config`: `python -m train.main --config=configs/packed.py:gpu` for 30 steps (its
     logged tokens/s and MFU).
  6. `train_1b_packed`, `train_1b_padded`: `train.bench steps` on a Llama-3.2-1B-shaped model (a
     Hugging Face config.json written here, random weights, bf16, Pallas attention, rows of 8192,
     vocabulary 128,256) on the same synthetic documents, FFD-packed and one per row, 2 warm-up,
     24 timed and 2 profiled steps: tokens/s, MFU, peak memory, the kernels of a profiled step,
     where the setup's time went.

The built-in corpus is built in the background from the start (CPU only). A stage starts only
while `--budget` seconds are not spent; its limit is what is left. On an H200, in this order, the
whole took 471 s: 45 s (gpu_report), 111 s (the sweep, then also at D = 64: its D = 128 record
came within the stage's 110 s limit, the D = 64 one did not, so the sweep is at D = 128 alone
now), 80 s (long-tailed), 45 s (attention_builtin, its corpus ready), 71 s (train_gpu_config),
65 s and 30 s (the 1B runs, then 10 timed steps each, at 527 and 400 ms a step; the second read
both programs from the compilation cache), and 25 s outside the stages (writing the 1B config,
starting and ending processes) with `--budget 470`. The budget now counts the config's writing
too; its default, 450 s, keeps the whole under 8 minutes.
`--dry-run` runs every stage on the CPU at toy sizes (Pallas in interpret mode): it proves the
command, not the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Sequence

from segpack import errors
from segpack.files import atomic_write_bytes

# Llama-3.2-1B's architecture (its public config.json): 1.24e9 parameters, tied embeddings.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                tie_word_embeddings=True,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192))
# The 1B runs' data and step: synthetic documents (median 600 tokens, log-normal, a long tail),
# 4 rows of 8192 per step, the blocked loss (never the [32768, 128256] logits), no remat.
TRAIN_1B = ["data.source=synthetic", "data.synthetic_vocab=128256", "data.synthetic_mean_len=600",
            "data.synthetic_docs=3000", "packing.seq_len=8192", "train.batch_size=4",
            "model.dtype=bfloat16", "attention.implementation=pallas", "loss.block_size=2048",
            "train.eval_every=0", "train.log_batches=False", "train.checkpoint_every=0"]
TRAIN_1B_DRY = ["packing.seq_len=512", "train.batch_size=2", "model.num_layers=1",
                "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
                "model.d_ff=128", "data.synthetic_docs=200", "data.synthetic_mean_len=100",
                "loss.block_size=256", "attention.interpret=True"]
ATTENTION_DRY = ["--interpret", "--seq-lens", "256", "--head-dims", "32", "--tokens", "512",
                 "--heads", "2", "--kv-heads", "2", "--repeats", "1", "--block", "32", "--rows", "4"]


@dataclasses.dataclass(frozen=True)
class Stage:
  """One measured command: its argv after `python -m` on the GPU and in a dry run, its limit."""

  name: str
  argv: tuple[str, ...]
  dry_argv: tuple[str, ...]
  limit_s: float
  needs_corpus: bool = False


def _steps_stage(out: pathlib.Path, layout: str, limit_s: float) -> Stage:
  """`train.bench steps` on the 1B-shaped model, `layout` "packed" or "padded"."""
  argv = ("train.bench", "steps", "--config", f"configs/{layout}.py", "--hf-config",
          str(out / "llama_1b"), "--workdir", str(out / "runs" / f"1b_{layout}"), "--warmup", "2",
          "--json", *[a for s in TRAIN_1B for a in ("--set", s)])
  return Stage(f"train_1b_{layout}", argv + ("--steps", "24", "--profile-steps", "2"),
               argv + tuple(a for s in TRAIN_1B_DRY for a in ("--set", s))
               + ("--steps", "2", "--profile-steps", "1"), limit_s)


def _attention_stage(name: str, args: tuple[str, ...], limit_s: float, *,
                     needs_corpus: bool = False) -> Stage:
  """`segpack bench attention` with the GPU sizes after `args`, or the dry-run sizes."""
  base = ("segpack", "bench", "attention", "--json", *args)
  sizes = ("--head-dims", "128", "--repeats", "5")
  return Stage(name, base + sizes, _dry_attention(base), limit_s, needs_corpus)


def _dry_attention(base: tuple[str, ...]) -> tuple[str, ...]:
  """The attention argv with its `--seq-lens` values replaced by the dry-run sizes."""
  argv, skipping = [], False
  for a in base:
    if a == "--seq-lens":
      skipping = True
      continue
    if skipping and not a.startswith("--"):
      continue
    skipping = False
    argv.append(a)
  return tuple(argv) + tuple(ATTENTION_DRY)


def stages(out: pathlib.Path) -> list[Stage]:
  """The stages of the module docstring, in order."""
  main = ("train.main", f"--workdir={out / 'runs' / 'gpu'}", "--config.train.num_steps=30",
          "--config.train.eval_every=0", "--config.train.checkpoint_every=0",
          "--config.train.log_every=5")
  return [
      Stage("gpu_report", ("segpack", "bench", "gpu-report", "--quick", "--no-bench", "--out",
                           str(out / "gpu_report.json")),
            ("segpack", "bench", "gpu-report", "--quick", "--no-bench", "--platform", "cpu",
             "--out", str(out / "gpu_report.json")), 150),
      _attention_stage("attention_longtail_sweep", ("--sigma", "1.5", "--seq-lens", "8192",
                                                    "--sweep"), 110),
      _attention_stage("attention_longtail", ("--sigma", "1.5", "--seq-lens", "2048", "32768"), 90),
      _attention_stage("attention_builtin", ("--lengths", "builtin", "--seq-lens", "8192", "2048",
                                             "32768"), 130, needs_corpus=True),
      Stage("train_gpu_config", main[:1] + ("--config=configs/packed.py:gpu",) + main[1:],
            main[:2] + ("--config=configs/packed.py:smoke", "--config.train.num_steps=4"), 120,
            True),
      _steps_stage(out, "packed", 150),
      _steps_stage(out, "padded", 150),
  ]


def write_hf_config(directory: pathlib.Path) -> None:
  """Llama-3.2-1B's config.json, written by transformers' `LlamaConfig` (no weights)."""
  from transformers import LlamaConfig  # optional: the [hf] extra, only to write the config
  LlamaConfig(**LLAMA_1B, torch_dtype="bfloat16").save_pretrained(directory)


def parse_output(stage: Stage, out: pathlib.Path, text: str) -> Any:
  """What a stage measured: its JSON report file, its JSON lines, or the run's metrics."""
  if stage.name == "gpu_report":
    path = out / "gpu_report.json"
    return json.loads(path.read_text()) if path.exists() else None
  if stage.name == "train_gpu_config":
    path = out / "runs" / "gpu" / "metrics.jsonl"
    if not path.exists():
      return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  records = []
  for line in text.splitlines():
    if line.startswith("{"):
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return records


def run_stage(stage: Stage, *, out: pathlib.Path, dry: bool, limit: float,
              env: dict[str, str]) -> dict[str, Any]:
  """Runs one stage in its own process; its record (status, seconds, what it measured)."""
  argv = [sys.executable, "-m", *(stage.dry_argv if dry else stage.argv)]
  log = out / f"{stage.name}.log"
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=limit, env=env)
    rc, text, err = proc.returncode, proc.stdout, proc.stderr
  except subprocess.TimeoutExpired as e:  # what it printed before the limit (bytes, or None)
    rc, text, err = None, (e.stdout or b"").decode(), (e.stderr or b"").decode()
  seconds = time.perf_counter() - t0
  log.write_text(f"$ {' '.join(argv)}\n{text}\n--- stderr ---\n{err}")
  status = "timed out" if rc is None else ("ok" if rc == 0 else f"exit {rc}")
  return dict(status=status, seconds=round(seconds, 1), command=" ".join(argv[2:]),
              result=parse_output(stage, out, text), stderr_tail=err[-3000:] if rc != 0 else "")


def _corpus_process(env: dict[str, str]) -> subprocess.Popen:
  code = "from segpack.text import corpus; corpus.ensure_builtin(size='full')"
  return subprocess.Popen([sys.executable, "-c", code], env={**env, "JAX_PLATFORMS": "cpu"},
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def collect(*, out: pathlib.Path, dry: bool, budget: float, only: Sequence[str] = ()
            ) -> dict[str, Any]:
  """Runs the stages within `budget` seconds; the report (also written to out/gpu_numbers.json)."""
  t0 = time.perf_counter()  # the budget covers everything this function does
  out.mkdir(parents=True, exist_ok=True)
  write_hf_config(out / "llama_1b")
  # One persistent compilation cache for all stages: the padded run's step is the packed run's
  # program (same shapes), so it is compiled once.
  env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_MEM_FRACTION="0.92",
             JAX_COMPILATION_CACHE_DIR=str(out / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1")
  corpus = _corpus_process(env)
  report: dict[str, Any] = dict(
      command=f"python -m train.bench gpu-numbers --out {out}" + (" --dry-run" if dry else ""),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      dry_run=dry, budget_s=budget, nvidia_smi=_nvidia_smi(), stages={})
  for stage in stages(out):
    if only and stage.name not in only:
      continue
    left = budget - (time.perf_counter() - t0)
    if left < 20:
      report["stages"][stage.name] = dict(status="not run: the time budget was spent")
      continue
    if stage.needs_corpus:  # the stage would build it itself, within its own limit
      try:
        corpus.wait(timeout=left / 2)
      except subprocess.TimeoutExpired:
        pass
      left = budget - (time.perf_counter() - t0)
    report["stages"][stage.name] = run_stage(stage, out=out, dry=dry,
                                             limit=min(stage.limit_s, left), env=env)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write_bytes(out / "gpu_numbers.json", json.dumps(report, indent=1).encode())
  corpus.kill()
  return report


def _nvidia_smi() -> str:
  try:
    return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                           "--format=csv"], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return "not available"


def add_arguments(ap: argparse.ArgumentParser) -> None:
  """The `gpu-numbers` subcommand's flags."""
  ap.add_argument("--out", required=True, help="the output directory")
  ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
  ap.add_argument("--budget", type=errors.at_least(30), default=450,
                  help="seconds for all stages together (the whole command: about 25 s more)")
  ap.add_argument("--only", nargs="+", default=(), metavar="STAGE",
                  choices=[s.name for s in stages(pathlib.Path("out"))],
                  help="run only these stages (the names of the module docstring)")


def run(args: argparse.Namespace) -> int:
  """`python -m train.bench gpu-numbers`: prints each stage's status; 0 when every one ran."""
  report = collect(out=pathlib.Path(args.out).resolve(), dry=args.dry_run, budget=args.budget,
                   only=args.only)
  for name, rec in report["stages"].items():
    print(f"{name:28} {rec['status']:12} {rec.get('seconds', '')}")
  return 0 if all(r["status"] == "ok" for r in report["stages"].values()) else 1

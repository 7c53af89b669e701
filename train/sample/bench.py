"""Decoding speed: the rollout engine's KV cache (`train.rollout.engine`) beside the full-forward one
(`train.sample.reference`), side by side in one run.

  python -m train.sample.bench [--workdir W] [--new-tokens 256] [--batches 1,8] [--json]
  python -m train.sample --benchmark            # the same, with the defaults

Algorithm:
  1. The model: a run's newest intact checkpoint (`--workdir`), else `configs/packed.py`'s model
     with random parameters (vocabulary `--vocab`).
  2. For each batch size `b`: `b` prompts of random ids, 8 to 32 tokens (seeded).
  3. KV cache: one `decode` call for all `b` prompts (one row each), compiled on a first call,
     then timed (best of `--repeats`).
  4. Full forward: `generate` for each prompt in turn, its length buckets compiled on a first
     pass, then timed once.
  5. Both greedy and with no stop id, so every prompt gets exactly `--new-tokens` tokens, and
     the two must decode the same tokens (the table says whether they did).
Tokens/s counts new tokens only. Seconds on a CPU say little about a GPU; the ratio is the
figure to quote.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from segpack import errors
from configs import packed as packed_config
from train.rollout import engine
from train.sample import reference
from train.sample import rollout_bench
from train import sharding as sharding_lib
from train.hf import config as hf_config, weights as hf_weights
from train.model import decoder as model_lib
from train.runs import loaded as loaded_run


def _model(workdir: str | None, vocab: int) -> tuple[model_lib.Decoder, str]:
  """Step 1: the model and how it was made."""
  if workdir:
    _, model, step = loaded_run.load_run(workdir)
    return model, f"{workdir} step {step}"
  config = packed_config.get_config()
  with config.unlocked():
    config.attention.implementation = "xla"
  model = model_lib.build(config, 0, vocab_size=vocab)
  c = model.cfg
  return model, (f"configs/packed.py model, random parameters: L={c.num_layers} E={c.d_model} "
                 f"H={c.num_heads} K={c.num_kv_heads} V={c.vocab_size}")


def measure(model: model_lib.Decoder, *, batch: int, new_tokens: int, repeats: int,
            seed: int = 0) -> dict[str, Any]:
  """Steps 2-5 for one batch size: seconds and tokens/s of both decoders."""
  rng = np.random.default_rng(seed + batch)
  vocab = model.cfg.vocab_size
  prompts = [[int(t) for t in rng.integers(3, vocab, size=int(rng.integers(8, 33)))]
             for _ in range(batch)]

  def kv():
    return [list(c.token_ids) for c in engine.generate(model, prompts,
                                                       max_new_tokens=new_tokens)]

  def full():
    return [reference.generate(model, p, max_new_tokens=new_tokens)[0] for p in prompts]

  kv()  # compile
  kv_seconds, kv_out = rollout_bench.best_of(kv, repeats, warm=False)
  reference.generate(model, max(prompts, key=len), max_new_tokens=new_tokens)  # compile buckets
  full_seconds, full_out = rollout_bench.best_of(full, 1, warm=False)
  total = batch * new_tokens
  return dict(batch=batch, new_tokens=new_tokens, kv_seconds=kv_seconds,
              full_seconds=full_seconds, kv_tokens_per_s=total / kv_seconds,
              full_tokens_per_s=total / full_seconds, speedup=full_seconds / kv_seconds,
              same_tokens=kv_out == full_out)


def table(rows: Sequence[dict[str, Any]], *, model: str) -> str:
  """The results as the printed table."""
  lines = [f"model: {model}",
           f"{'batch':>5} {'new':>5} {'KV cache tok/s':>15} {'full forward tok/s':>19} "
           f"{'speedup':>8} {'same tokens':>12}"]
  for r in rows:
    lines.append(f"{r['batch']:>5} {r['new_tokens']:>5} {r['kv_tokens_per_s']:>15.1f} "
                 f"{r['full_tokens_per_s']:>19.1f} {r['speedup']:>7.1f}x "
                 f"{'yes' if r['same_tokens'] else 'NO':>12}")
  return "\n".join(lines)


def run(*, workdir: str | None = None, new_tokens: int = 256, batches: Sequence[int] = (1, 8),
        repeats: int = 2, vocab: int = 8192, as_json: bool = False) -> list[dict[str, Any]]:
  """Measures every batch size and prints the table (or JSON)."""
  model, described = _model(workdir, vocab)
  rows = [measure(model, batch=b, new_tokens=new_tokens, repeats=repeats) for b in batches]
  print(json.dumps({"model": described, "results": rows}, indent=1) if as_json
        else table(rows, model=described))
  return rows


def _imported(model_dir: str) -> model_lib.Decoder:
  """A Hugging Face directory imported as `model.init_from` does."""
  config = packed_config.get_config()
  with config.unlocked():
    config.model.init_from = model_dir
    config.attention.implementation = "xla"
  hf_config.adopt(config)
  return hf_weights.load_decoder(config, mesh=sharding_lib.make_mesh())


def run_rollout(*, workdir: str | None, vocab: int, quick: bool, repeats: int,
                as_json: bool) -> dict[str, Any]:
  """The rollout engine's sections (`train.sample.rollout_bench`) on one model: a run's, else a
  random Llama written by transformers and imported (the packed config's random model without
  transformers)."""
  with tempfile.TemporaryDirectory() as directory:
    model_dir = None if workdir else rollout_bench.hf_model(directory, vocab=vocab)
    if model_dir is not None:
      model = _imported(model_dir)
      described = (f"random Llama (transformers) imported: L={model.cfg.num_layers} "
                   f"E={model.cfg.d_model} H={model.cfg.num_heads} K={model.cfg.num_kv_heads} "
                   f"V={model.cfg.vocab_size}")
    else:
      model, described = _model(workdir, vocab)
    sections = rollout_bench.run(model, model_dir=model_dir, quick=quick, repeats=repeats)
  out = {"model": described, **sections}
  if as_json:
    print(json.dumps(out, indent=1))
  else:
    print(f"model: {described}")
    for name, rows in sections.items():
      print(rollout_bench.section_table(name, rows))
  return out


@errors.command("python -m train.sample.bench")
def main(argv: Sequence[str] | None = None) -> int:
  """Runs the benchmark (`python -m train.sample --benchmark` passes its `--workdir`)."""
  p = argparse.ArgumentParser(prog="python -m train.sample.bench", description=__doc__.split(
      "\n")[0])
  p.add_argument("--workdir", default=None, help="a run to load (default: a random model)")
  p.add_argument("--new-tokens", type=int, default=256, help="new tokens per prompt")
  p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
  p.add_argument("--repeats", type=int, default=2, help="KV-cache timings, best kept")
  p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the random model")
  p.add_argument("--json", action="store_true", help="print JSON instead of the table")
  p.add_argument("--only", choices=("decode", "rollout"), default=None,
                 help="one part: KV cache vs full forward, or the rollout engine's sections")
  p.add_argument("--quick", action="store_true", help="the rollout sections at a quarter size")
  args = p.parse_args([] if argv is None else argv)
  try:
    batches = [int(b) for b in args.batches.split(",")]
  except ValueError:
    p.error(f"--batches must be comma-separated ints, got {args.batches!r}")
  if args.only != "rollout":
    run(workdir=args.workdir, new_tokens=args.new_tokens, batches=batches,
        repeats=args.repeats, vocab=args.vocab, as_json=args.json)
  if args.only != "decode":
    run_rollout(workdir=args.workdir, vocab=args.vocab, quick=args.quick, repeats=args.repeats,
                as_json=args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

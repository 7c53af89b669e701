"""Training benchmarks: `python -m train.bench packed|sft|preference|rl|steps|gpu-numbers [...]`
(`--help` after any).

`packed`: packed vs padded training on the same documents (this module).
`sft`: chat fine-tuning, padding vs minibatch vs global packing (`train/bench/sft.py`, docs/sft.md).
`preference`: DPO on packed pairs vs padded pairs (`train/bench/preference.py`, docs/preference.md).
`rl`: GRPO on groups padded vs packed, prompt copied or stored once (`train/bench/rl.py`, docs/rl.md).
`steps`: the trainer's own step on any config, timed and profiled: MFU (`train/bench/steps.py`).
`gpu-numbers`: every GPU figure in one JSON, stage by stage (`train/bench/gpu_numbers.py`).

`packed`, algorithm:
  1. Sample `--docs` documents (seeded) from the built-in corpus's training split.
  2. Plan them twice at `--seq-len`: FFD packing (`configs/packed.py`) and one document per row
     (`configs/padded.py`, strategy "pad"); both runs see exactly these documents' tokens.
  3. For each, build the same model and optimizer, compile the step on a throw-away batch, then
     train one full epoch over the rows (the last batch filled with padding rows) and time it.
  4. Report real (non-padding) tokens, rows, steps, slot utilization, wall time to consume the
     documents and real tokens/s; the speedup is packed / padded real tokens/s.

Example: 400 documents averaging 60 tokens fill ~25 packed rows of 1024 slots but 400 padded
rows, so with the cost of a step proportional to its slots, packing is ~16x faster per real token.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import packed as packed_config
from segpack import shards
from segpack import errors
from segpack.data.options import SpecialTokens
from segpack.data.packed import pack_dataset
from segpack.loss import IGNORE_INDEX
from segpack.text import corpus
from train.model import decoder as model_lib
from train.bench import preference as preference_bench
from train.bench import rl as rl_bench
from train.bench import gpu_numbers
from train.bench import sft as sft_bench
from train.bench import steps as steps_bench
from train import sharding as sharding_lib
from train import steps as steps_lib


def pad_batch(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  """Pads a short (last) eval batch with all-padding rows to `rows` rows."""
  n = len(batch["input_ids"])
  if n == rows:
    return batch
  out = {}
  for key, value in batch.items():
    fill = IGNORE_INDEX if key == "labels" else 0
    out[key] = np.concatenate([value, np.full((rows - n,) + value.shape[1:], fill, value.dtype)])
  return out

def _documents(size: str, num_docs: int, seed: int) -> tuple[list[np.ndarray], int, dict[str, int]]:
  built = corpus.ensure_builtin(size=size)
  source = shards.ShardSource(built.train_dir)
  pick = np.sort(np.random.default_rng(seed).choice(len(source), size=min(num_docs, len(source)),
                                                    replace=False))
  sp = sentencepiece.SentencePieceProcessor(model_file=str(built.spm_model))
  return ([np.asarray(source[int(i)]) for i in pick], int(built.vocab_size),
          dict(bos_id=int(sp.bos_id()), eos_id=int(sp.eos_id())))


def _epoch_batches(docs, *, strategy: str, seq_len: int, batch_size: int, ids: dict[str, int]):
  rows = pack_dataset(docs, seq_len=seq_len, strategy=strategy, shuffle=False, num_epochs=1,
                      special_tokens=SpecialTokens(**ids))
  batches = rows.batch(batch_size, drop_remainder=False)
  return [pad_batch(batches[i], batch_size) for i in range(len(batches))]


def run_one(config: Any, docs, *, strategy: str, vocab: int, ids: dict[str, int]
            ) -> dict[str, float]:
  """Trains one epoch over `docs` packed with `strategy`; returns the measurements."""
  t = config.train
  batches = _epoch_batches(docs, strategy=strategy, seq_len=config.packing.seq_len,
                           batch_size=t.batch_size, ids=ids)
  mesh = sharding_lib.make_mesh()
  sharding_lib.check_batch(t.batch_size, mesh=mesh)
  tx, schedule = steps_lib.make_optimizer(t)
  # Segment ids run 1..n in every row, so the largest id is the most segments in a row.
  max_segments = max(int(b["segment_ids"].max()) for b in batches)
  graphdef, params = nnx.split(model_lib.build(config, t.seed, vocab_size=vocab, mesh=mesh,
                                               segment_bound=max_segments))
  replicated = NamedSharding(mesh, P())
  state = jax.device_put(dict(params=params, opt_state=tx.init(params), step=jnp.int32(0)),
                         replicated)
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=1),
                 in_shardings=(replicated, sharding_lib.batch_sharding(mesh)),
                 out_shardings=(replicated, replicated), donate_argnames=("state",))
  to_device = functools.partial(sharding_lib.global_batch, mesh=mesh)
  # Compile (and run once) on a copy: the timed loop reuses this executable, never retraces.
  jax.block_until_ready(step(jax.tree.map(jnp.copy, state), to_device(batches[0])))
  real = sum(int((b["segment_ids"] != 0).sum()) for b in batches)
  t0 = time.perf_counter()
  for b in batches:
    state, metrics = step(state, to_device(b))
  jax.block_until_ready(metrics)
  wall = time.perf_counter() - t0
  slots = len(batches) * t.batch_size * config.packing.seq_len
  return dict(steps=len(batches), real_tokens=real, slot_utilization=real / slots, wall_s=wall,
              real_tokens_per_s=real / wall, final_loss=float(metrics["loss"]))


def bench(*, size: str, num_docs: int, seq_len: int, batch_size: int, seed: int
          ) -> dict[str, Any]:
  """Runs packed and padded on the same documents; returns the JSON-able result."""
  docs, vocab, ids = _documents(size, num_docs, seed)
  config = packed_config.get_config()
  config.packing.seq_len = seq_len
  config.train.batch_size = batch_size
  out: dict[str, Any] = dict(documents=len(docs), doc_tokens=int(sum(len(d) for d in docs)),
                             seq_len=seq_len, batch_size=batch_size, corpus=size,
                             device=str(jax.devices()[0].platform), num_devices=jax.device_count())
  for name, strategy in (("packed", "ffd"), ("padded", "pad")):
    for key, value in run_one(config, docs, strategy=strategy, vocab=vocab, ids=ids).items():
      out[f"{name}_{key}"] = value
  out["speedup"] = out["packed_real_tokens_per_s"] / out["padded_real_tokens_per_s"]
  return out


def _table(r: dict[str, Any]) -> str:
  lines = [f"{r['documents']} documents ({r['doc_tokens']:,} tokens) of the {r['corpus']} corpus, "
           f"seq_len {r['seq_len']}, batch {r['batch_size']}, {r['num_devices']} {r['device']} "
           "device(s)",
           f"{'':8} {'steps':>6} {'real tokens':>12} {'util':>7} {'time (s)':>9} "
           f"{'real tok/s':>11}"]
  for name in ("packed", "padded"):
    lines.append(f"{name:8} {r[name + '_steps']:>6} {r[name + '_real_tokens']:>12,} "
                 f"{r[name + '_slot_utilization']:>7.1%} {r[name + '_wall_s']:>9.1f} "
                 f"{r[name + '_real_tokens_per_s']:>11,.0f}")
  lines.append(f"packed / padded real tokens/s: {r['speedup']:.2f}x")
  return "\n".join(lines)


# The subcommands besides `packed`, each a module with `add_arguments(parser)` and `run(args)`.
SUBCOMMANDS = {"sft": sft_bench, "preference": preference_bench, "rl": rl_bench,
               "steps": steps_bench, "gpu-numbers": gpu_numbers}
SUBCOMMAND_HELP = {
    "sft": "chat fine-tuning: padding vs minibatch vs global packing",
    "preference": "DPO: packed pairs vs pairs padded to the longest",
    "rl": "GRPO: groups padded vs packed with the prompt copied vs stored once",
    "steps": "the trainer's step on a config: time, MFU, top kernels",
    "gpu-numbers": "every GPU figure of docs/benchmarks.md, one JSON",
}


def build_parser() -> argparse.ArgumentParser:
  """The `python -m train.bench` parser: one declared subcommand per benchmark."""
  raw = argparse.RawDescriptionHelpFormatter
  parser = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__,
                                   formatter_class=raw)
  sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
  packed = sub.add_parser("packed", help="packed vs padded training on the same documents",
                          description=__doc__, formatter_class=raw)
  packed.add_argument("--size", default="full", choices=("full", "small"), help="built-in corpus")
  packed.add_argument("--docs", type=errors.at_least(1),
                      default=100, help="documents sampled from the corpus")
  packed.add_argument("--seq-len", type=errors.at_least(2), default=1024, help="slots per row")
  packed.add_argument("--batch-size", type=errors.at_least(1), default=8, help="rows per step")
  packed.add_argument("--seed", type=int, default=0, help="document sampling seed")
  packed.add_argument("--json", action="store_true", help="print one JSON object")
  for name, module in SUBCOMMANDS.items():  # each declares its own flags and runs itself
    module.add_arguments(sub.add_parser(name, help=SUBCOMMAND_HELP[name],
                                        description=module.__doc__, formatter_class=raw))
  return parser


@errors.command("python -m train.bench")
def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m train.bench BENCHMARK ...`; returns the exit status."""
  args = build_parser().parse_args(argv)
  if args.benchmark in SUBCOMMANDS:
    return SUBCOMMANDS[args.benchmark].run(args)
  result = bench(size=args.size, num_docs=args.docs, seq_len=args.seq_len,
                 batch_size=args.batch_size, seed=args.seed)
  print(json.dumps(result, sort_keys=True) if args.json else _table(result))
  return 0

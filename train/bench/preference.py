"""`python -m train.bench preference`: DPO steps on packed pairs vs pairs padded to the longest.

Algorithm:
  1. Draw `--pairs` synthetic pairs of a realistic shape (seeded): long shared prompts (log-normal,
     median `--prompt` tokens) and two answers of uneven length each (log-normal, median
     `--answer` tokens), every pair at most `--seq-len` slots.
  2. Lay them out three ways, each pair whole in one row (`segpack.data.pairs.pack_pairs`):
     - `padded`: one pair per row, each batch cut to its longest row (rounded up to
       `--pad-multiple` slots: each width is a program to compile),
       as padding collators pad to the longest of a batch (TRL pads each of 2B sequences to the
       longest, which is at least as long: this baseline is the cheaper one);
     - `packed`: pairs packed whole into rows of `--seq-len` by exact FFD;
     - `shared`: packed, each prompt stored once and both answers as branches that see it
       (`preference.shared_prefix`).
  3. For each, compile the DPO train step (`train.steps.make_train_step`, the trainer's step) on
     every batch shape once, then time one epoch over every pair.
  4. Print pairs/s, slots and real-token utilization, and the ratios to `padded`.

On a CPU the XLA attention computes every row's whole `[S, S]` score matrix; on a GPU the Pallas
kernel skips other segments' blocks. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import dpo as dpo_config
from segpack import errors
from segpack.loss import preference as preference_loss
from segpack.data import pairs as pairs_lib
from segpack.data.options import SpecialTokens
from train.model import decoder as model_lib
from train import sharding as sharding_lib
from train import steps as steps_lib
from train.preference import objective as objective_lib

LAYOUTS = ("padded", "packed", "shared")
VOCAB = 512


class PairDocs:
  """In-memory pair documents with loss masks (documents 2k, 2k + 1: pair k)."""

  has_loss_mask = True

  def __init__(self, docs: list[np.ndarray], masks: list[np.ndarray]):
    self.docs, self.masks = docs, masks

  def __len__(self) -> int:
    return len(self.docs)

  def __getitem__(self, i: int) -> np.ndarray:
    return self.docs[i]

  def loss_mask(self, i: int) -> np.ndarray:
    return self.masks[i]


def make_pairs(*, num_pairs: int, prompt: int, answer: int, seq_len: int, seed: int) -> PairDocs:
  """Step 1: pairs of log-normal prompt and answer lengths, each pair within `seq_len` slots."""
  rng = np.random.default_rng(seed)
  docs, masks = [], []
  while len(docs) < 2 * num_pairs:
    p, a, b = (max(1, int(x)) for x in (rng.lognormal(np.log(prompt), 0.7),
                                         rng.lognormal(np.log(answer), 1.0),
                                         rng.lognormal(np.log(answer), 1.0)))
    if 2 * p + a + b + 4 > seq_len:
      continue
    head = rng.integers(3, VOCAB, p)
    for n in (a, b):
      docs.append(np.concatenate([head, rng.integers(3, VOCAB, n)]).astype(np.int32))
      masks.append(np.concatenate([np.zeros(p), np.ones(n)]).astype(np.uint8))
  return PairDocs(docs, masks)


def _batches(source: PairDocs, layout: str, *, seq_len: int, batch_size: int,
             pad_multiple: int = 32):
  """Step 2: one epoch of global batches of `layout` (padding rows fill the last one)."""
  rows = pairs_lib.pack_pairs(
      source, seq_len=seq_len, strategy="pad" if layout == "padded" else "ffd", shuffle=False,
      num_epochs=1, special_tokens=SpecialTokens(bos_id=1, eos_id=2),
      shared_prefix=layout == "shared")
  builder = pairs_lib.pair_builder(rows)
  builder.set_reference(np.zeros((len(source) // 2, 2)))
  n = rows.rows_in_epoch(0)
  out = []
  for start in range(0, n, batch_size):
    index = np.arange(start, start + batch_size)
    batch = builder.build(np.where(index < n, index, -1))
    if layout == "padded":  # cut to the batch's longest row, rounded up to pad_multiple
      longest = int((batch["segment_ids"] != 0).sum(axis=1).max())
      width = min(seq_len, -(-longest // pad_multiple) * pad_multiple)
      batch = {k: v[:, :width] if v.shape[1] == seq_len else v for k, v in batch.items()}
    out.append(batch)
  return out


def run_layout(config: Any, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
  """Step 3: the trainer's DPO step over `batches`, timed after compiling every shape."""
  t = config.train
  mesh = sharding_lib.make_mesh()
  tx, schedule = steps_lib.make_optimizer(t)
  graphdef, params = nnx.split(model_lib.build(config, t.seed, vocab_size=VOCAB, mesh=mesh))
  replicated = NamedSharding(mesh, P())
  state = jax.device_put(dict(params=params, opt_state=tx.init(params), step=jnp.int32(0)),
                         replicated)
  objective = objective_lib.PreferenceObjective(
      pair_loss=preference_loss.PreferenceLoss(loss="dpo"))
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=1, objective=objective),
                 out_shardings=(replicated, replicated), donate_argnames=("state",))
  to_device = functools.partial(sharding_lib.global_batch, mesh=mesh)
  for width in sorted({b["input_ids"].shape[1] for b in batches}):  # compile every shape once
    first = next(b for b in batches if b["input_ids"].shape[1] == width)
    jax.block_until_ready(step(jax.tree.map(jnp.copy, state), to_device(first)))
  t0 = time.perf_counter()
  for b in batches:
    state, metrics = step(state, to_device(b))
  jax.block_until_ready(metrics)
  wall = time.perf_counter() - t0
  slots = sum(b["input_ids"].size for b in batches)
  real = sum(int((b["segment_ids"] != 0).sum()) for b in batches)
  pairs = sum(int((b["pair_index"] >= 0).sum()) for b in batches)
  return dict(steps=len(batches), slots=slots, real_tokens=real, utilization=real / slots,
              pairs=pairs, wall_s=wall, pairs_per_s=pairs / wall)


def bench(*, num_pairs: int, prompt: int, answer: int, seq_len: int, batch_size: int,
          seed: int, d_model: int = 512, pad_multiple: int = 32) -> dict[str, Any]:
  """Steps 1-4; the JSON-able result."""
  source = make_pairs(num_pairs=num_pairs, prompt=prompt, answer=answer, seq_len=seq_len,
                      seed=seed)
  config = dpo_config.get_config()
  config.packing.seq_len = seq_len
  config.train.batch_size = batch_size
  config.train.learning_rate, config.train.warmup_steps, config.train.num_steps = 1e-4, 1, 10
  m = config.model
  # 2 layers of width d_model: attention is about a fifth of a step's FLOPs at 1024 slots, as in
  # billion-parameter models on rows of 8192; a narrower model would time attention alone.
  m.num_layers, m.d_model, m.d_ff, m.head_dim = 2, d_model, 4 * d_model, 64
  m.num_heads, m.num_kv_heads = max(1, d_model // 64), max(1, d_model // 128)
  out: dict[str, Any] = dict(pairs=num_pairs, prompt_median=prompt, answer_median=answer,
                             d_model=d_model, pad_multiple=pad_multiple,
                             attention=config.attention.implementation or "default",
                             seq_len=seq_len, batch_size=batch_size,
                             device=str(jax.devices()[0].platform), num_devices=jax.device_count())
  for layout in LAYOUTS:
    result = run_layout(config, _batches(source, layout, seq_len=seq_len, batch_size=batch_size,
                                         pad_multiple=pad_multiple))
    out.update({f"{layout}_{k}": v for k, v in result.items()})
  for layout in ("packed", "shared"):
    out[f"{layout}_speedup"] = out[f"{layout}_pairs_per_s"] / out["padded_pairs_per_s"]
  return out


def table(r: dict[str, Any]) -> str:
  """Step 4's table."""
  lines = [f"{r['pairs']} pairs (prompt median {r['prompt_median']}, answers median "
           f"{r['answer_median']} tokens), seq_len {r['seq_len']}, batch {r['batch_size']} rows, "
           f"{r['num_devices']} {r['device']} device(s)",
           f"{'':8} {'steps':>6} {'slots':>10} {'util':>7} {'time (s)':>9} {'pairs/s':>9} "
           f"{'vs padded':>10}"]
  for name in LAYOUTS:
    ratio = r.get(f"{name}_speedup", 1.0)
    lines.append(f"{name:8} {r[name + '_steps']:>6} {r[name + '_slots']:>10,} "
                 f"{r[name + '_utilization']:>7.1%} {r[name + '_wall_s']:>9.2f} "
                 f"{r[name + '_pairs_per_s']:>9.1f} {ratio:>9.2f}x")
  return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The `preference` subcommand's flags."""
  p.add_argument("--pairs", type=errors.at_least(1), default=96, help="pairs to train on")
  p.add_argument("--prompt", type=errors.at_least(1), default=96,
                 help="median prompt tokens")
  p.add_argument("--answer", type=errors.at_least(1), default=32, help="median answer tokens")
  p.add_argument("--d-model", type=errors.at_least(64), default=512, help="the model's width")
  p.add_argument("--pad-multiple", type=errors.at_least(1), default=32,
                 help="padded: batch widths rounded up to this")
  p.add_argument("--seq-len", type=errors.at_least(64), default=1024, help="slots per row")
  p.add_argument("--batch-size", type=errors.at_least(1), default=8, help="rows per step")
  p.add_argument("--seed", type=int, default=0, help="the pairs' seed")
  p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
  result = bench(num_pairs=args.pairs, prompt=args.prompt, answer=args.answer,
                 seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                 d_model=args.d_model, pad_multiple=args.pad_multiple)
  print(json.dumps(result, sort_keys=True) if args.json else table(result))
  return 0

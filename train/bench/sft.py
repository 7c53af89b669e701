"""`python -m train.bench sft`: padding vs minibatch vs global packing for chat fine-tuning.

Trains the same tiny decoder for one epoch of the built-in chat corpus (assistant-only loss) three
ways and prints, for each: optimizer steps, rows per step, padded-slot fraction, real tokens/s and
the held-out loss after the epoch.

* `padding`: unpacked training: each minibatch of `--examples-per-batch` conversations, one
  conversation per row (`pack_minibatches(strategy="pad")`).
* `minibatch`: the same minibatches, each packed FFD into as few rows as fit
  (`pack_minibatches(strategy="ffd")`): the same steps on the same examples.
* `global`: FFD over the whole epoch, batches of `--examples-per-batch` rows (`pack_dataset`):
  fewest rows, so fewer optimizer steps.

Usage:
  python -m train.bench sft                    # small chat corpus, about a minute on 2 cores
  python -m train.bench sft --size full --max-train 1500 --json   # one JSON object instead

`train/bench/training.py` declares the `sft` subcommand with this module's `add_arguments` and runs `run`.

Tokens/s counts real (non-padding) slots over the training wall time after the first step of each
batch shape (compilation excluded); it measures this machine, not a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from segpack import errors
from segpack.text.chat import corpus as chat_corpus
from segpack import loss as loss_lib
from segpack.data.minibatch_dataset import pack_minibatches
from segpack.data.packed import pack_dataset
from segpack import shards
from train.model import config as model_config
from train.model import decoder as model_lib

METHODS = ("padding", "minibatch", "global")


class SubsetSource:
  """The first `n` documents of a shard source, with its loss mask and special ids."""

  def __init__(self, source: shards.ShardSource, n: int):
    self._source = source
    self._n = min(int(n), len(source))
    self.lengths = np.asarray(source.lengths[:self._n])
    self.has_loss_mask = source.has_loss_mask
    self.vocab_size = source.vocab_size
    self.bos_id = source.record.special_id("bos_id")
    self.eos_id = source.record.special_id("eos_id")

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, i: int) -> np.ndarray:
    return self._source[i]

  def loss_mask(self, i: int) -> np.ndarray:
    return self._source.loss_mask(i)


@dataclasses.dataclass
class Result:
  method: str
  steps: int
  rows_per_step: int
  padded_slot_fraction: float
  real_tokens_per_s: float
  trained_tokens: int
  train_seconds: float
  heldout_loss: float


def _batches(method: str, source: Any, *, seq_len: int, k: int, seed: int) -> list[dict]:
  """One epoch of batches (NumPy), each a dict of `[rows, seq_len]` int32 arrays."""
  common = dict(seq_len=seq_len, seed=seed, num_epochs=1)
  if method == "global":
    ds = pack_dataset(source, strategy="ffd", **common)
    batched = ds.batch(k)
    return [batched[i] for i in range(len(batched))]
  ds = pack_minibatches(source, examples_per_batch=k, process_index=0, process_count=1,
                        strategy="pad" if method == "padding" else "ffd", **common)
  return [ds[i] for i in range(len(ds))]


def _decoder(vocab: int, args: argparse.Namespace) -> model_lib.Decoder:
  cfg = model_config.DecoderConfig(
      vocab_size=vocab, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
      num_kv_heads=args.heads, head_dim=args.d_model // args.heads, d_ff=args.d_model * 3,
      attention_implementation="xla")
  return model_lib.Decoder(cfg, rngs=nnx.Rngs(params=args.seed))


def _loss(model, batch):
  logits_BxSxV = model(batch["input_ids"], segment_ids=batch["segment_ids"],
                       segment_positions=batch["segment_positions"])
  return loss_lib.cross_entropy_loss(logits_BxSxV, batch["labels"])


@nnx.jit
def _train_step(model, optimizer, batch):
  (loss, _), grads = nnx.value_and_grad(_loss, has_aux=True)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def _eval_step(model, batch):
  logits_BxSxV = model(batch["input_ids"], segment_ids=batch["segment_ids"],
                       segment_positions=batch["segment_positions"])
  token_loss_BxS = loss_lib.token_cross_entropy(logits_BxSxV, batch["labels"])
  return loss_lib.token_loss_sum(token_loss_BxS, batch["labels"])


def heldout_loss(model, batches: Sequence[dict]) -> float:
  """Mean cross-entropy over every trained (assistant) token of the held-out batches."""
  total = count = 0.0
  for batch in batches:
    s, n = _eval_step(model, {k: jnp.asarray(v) for k, v in batch.items()})
    total, count = total + float(s), count + float(n)
  return total / max(count, 1.0)


def run_method(method: str, train_source: Any, eval_batches: Sequence[dict],
               args: argparse.Namespace) -> Result:
  batches = _batches(method, train_source, seq_len=args.seq_len, k=args.examples_per_batch,
                     seed=args.seed)
  model = _decoder(train_source.vocab_size, args)
  optimizer = nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=0.0), wrt=nnx.Param)
  slots = sum(b["input_ids"].size for b in batches)
  real = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
  trained = sum(int((b["labels"] != loss_lib.IGNORE_INDEX).sum()) for b in batches)
  seen_shapes, timed_real, seconds = set(), 0, 0.0
  for batch in batches:
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    start = time.perf_counter()
    jax.block_until_ready(_train_step(model, optimizer, jb))
    if batch["input_ids"].shape in seen_shapes:  # the first step of a shape compiles
      seconds += time.perf_counter() - start
      timed_real += int((batch["segment_ids"] > 0).sum())
    seen_shapes.add(batch["input_ids"].shape)
  return Result(method=method, steps=len(batches),
                rows_per_step=int(max(b["input_ids"].shape[0] for b in batches)),
                padded_slot_fraction=1.0 - real / slots,
                real_tokens_per_s=timed_real / seconds if seconds else float("nan"),
                trained_tokens=trained, train_seconds=seconds,
                heldout_loss=heldout_loss(model, eval_batches))


def _table(results: Sequence[Result]) -> str:
  head = (f"{'method':<10} {'steps':>6} {'rows/step':>9} {'padded':>7} {'real tok/s':>11} "
          f"{'trained tok':>11} {'held-out loss':>13}")
  lines = [head, "-" * len(head)]
  for r in results:
    lines.append(f"{r.method:<10} {r.steps:>6} {r.rows_per_step:>9} "
                 f"{r.padded_slot_fraction:>6.1%} {r.real_tokens_per_s:>11,.0f} "
                 f"{r.trained_tokens:>11,} {r.heldout_loss:>13.4f}")
  return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
  """Declares the flags of `python -m train.bench sft` on `p`."""
  p.add_argument("--size", choices=("small", "full"), default="small",
                 help="built-in chat corpus size")
  p.add_argument("--max-train", type=errors.at_least(1), default=None,
                 help="use the first N training conversations (default: all)")
  p.add_argument("--seq-len", type=errors.at_least(2), default=512)
  p.add_argument("--examples-per-batch", type=errors.at_least(1), default=16)
  p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
  p.add_argument("--lr", type=errors.at_least(0.0, float), default=3e-3)
  p.add_argument("--d-model", type=errors.at_least(1), default=64)
  p.add_argument("--layers", type=errors.at_least(1), default=2)
  p.add_argument("--heads", type=errors.at_least(1), default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--cache-dir", default=None)
  p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
  """Trains one epoch per method in `args.methods`, prints the table (or JSON); returns 0."""
  data = chat_corpus.ensure_builtin_chat(size=args.size, cache_dir=args.cache_dir)
  train = shards.ShardSource(data.train_dir)
  source = SubsetSource(train, args.max_train or len(train))
  held = pack_dataset(data.eval_dir, seq_len=args.seq_len, num_epochs=1,
                      shuffle=False).batch(args.examples_per_batch)
  eval_batches = [held[i] for i in range(len(held))]
  print(f"built-in chat corpus ({args.size}): {len(source)} training conversations, "
        f"{int(source.lengths.sum()):,} tokens; {len(shards.ShardSource(data.eval_dir))} held out; "
        f"seq_len {args.seq_len}, {args.examples_per_batch} examples per batch; "
        f"model d={args.d_model} layers={args.layers}; {jax.default_backend()}",
        file=sys.stderr if args.json else sys.stdout, flush=True)
  results = []
  for method in args.methods:
    results.append(run_method(method, source, eval_batches, args))
    print(f"  {method}: done", file=sys.stderr, flush=True)
  if args.json:
    print(json.dumps({"args": vars(args), "results": [dataclasses.asdict(r) for r in results]},
                     sort_keys=True))
  else:
    print(_table(results))
  return 0

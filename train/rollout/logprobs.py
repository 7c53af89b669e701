"""The log-prob contract: the trainer's per-token log-probs of (prompt, completion) sequences on
packed rows, the numbers an RL objective and an evaluation must share with the sampler.

`sequence_logprobs` computes, for every completion token, `log_softmax(logits / T)[token]` with
the trainer's own forward pass and per-token loss (`train.model.head_loss.token_losses`, full or
blocked), the same number the rollout engine records as `Completion.logprobs` (within float
rounding; `tests/train/rollout/test_logprobs.py`).

Algorithm:
  1. Each sequence is one document `prompt + completion`; its labels are the next token at the
     positions whose next token is a completion token (the last prompt token up to the
     second-to-last token), -100 elsewhere, so only completion tokens are scored.
  2. The documents are packed into rows of `seq_len` slots by exact first-fit-decreasing
     (`segpack.packing.plan`), segment ids 1..n, positions from 0 in every segment: a sequence
     attends to itself only, so packing changes none of its numbers.
  3. Batches of `batch_size` rows (the last one padded with empty rows) run one jitted forward
     each; a sequence's log-probs are its labelled slots, in order.

Example: sequences `([a, b], [c, d])` and `([e], [f])` with `seq_len` 8 make one row
`[a b c d e f - -]`, segment ids `[1 1 1 1 2 2 0 0]`, labels `[-100 c d -100 f -100 -100 -100]`:
the log-probs of `c, d` and of `f`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from segpack import packing
from segpack.loss import IGNORE_INDEX
from train.model import head_loss
from train.rollout.sampling import DecodeError


def _documents(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *, seq_len: int,
               vocab_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """Step 1: every sequence's tokens and labels, checked."""
  out = []
  for i, (prompt, completion) in enumerate(sequences):
    tokens = np.asarray([*prompt, *completion], np.int64)
    if not len(prompt) or not len(completion):
      raise DecodeError(f"sequence {i}: a prompt and a completion of at least one token each are "
                        f"needed, got {len(prompt)} and {len(completion)}")
    if len(tokens) > seq_len:
      raise DecodeError(f"sequence {i} has {len(tokens)} tokens: more than seq_len={seq_len}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
      raise DecodeError(f"sequence {i}: token ids must lie in [0, {vocab_size})")
    labels = np.full(len(tokens), IGNORE_INDEX, np.int64)
    labels[len(prompt) - 1:-1] = tokens[len(prompt):]
    out.append((tokens, labels))
  return out


@functools.partial(jax.jit, static_argnames=("graphdef", "block_size", "temperature"))
def _scored(graphdef: Any, params: Any, batch: dict[str, jax.Array], *, block_size: int,
            temperature: float) -> jax.Array:
  model = nnx.merge(graphdef, params)
  return -head_loss.token_losses(model, batch, block_size=block_size, temperature=temperature)


def _rows(documents, plan, rows: range, seq_len: int) -> tuple[dict[str, np.ndarray], list]:
  """Step 2 for some plan rows: the batch's arrays, and where each piece's labels lie."""
  batch = {k: np.zeros((len(rows), seq_len), np.int32)
           for k in ("input_ids", "segment_ids", "segment_positions")}
  batch["labels"] = np.full((len(rows), seq_len), IGNORE_INDEX, np.int32)
  where = []
  for b, r in enumerate(rows):
    at = 0
    for seg, piece in enumerate(range(plan.row_splits[r], plan.row_splits[r + 1]), start=1):
      tokens, labels = documents[int(plan.doc[piece])]
      n = len(tokens)
      batch["input_ids"][b, at:at + n], batch["labels"][b, at:at + n] = tokens, labels
      batch["segment_ids"][b, at:at + n] = seg
      batch["segment_positions"][b, at:at + n] = np.arange(n)
      where.append((int(plan.doc[piece]), b, at, n))
      at += n
  return batch, where


def sequence_logprobs(model: Any, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                      seq_len: int, temperature: float = 1.0, batch_size: int = 8,
                      block_size: int = 0) -> list[np.ndarray]:
  """Every completion token's log-prob under `model`, as the trainer computes it.

  Args:
    model: a `train.model.decoder.Decoder` (parameters on one device or as a run places them).
    sequences: `(prompt ids, completion ids)` pairs, each at least one token.
    seq_len: slots per packed row (a sequence longer than that is refused).
    temperature: the logits are divided by it (the sampler's temperature; 1: the model's own).
    batch_size: rows per forward pass.
    block_size: the blocked loss's positions per block (0: the full logits).

  Returns:
    One float32 array per sequence: its completion tokens' log-probs, in order.

  Raises:
    DecodeError: an empty prompt or completion, a sequence longer than `seq_len`, ids outside
      the vocabulary, a temperature that is not > 0.
  """
  if not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
    raise DecodeError(f"temperature must be a number > 0, got {temperature!r}")
  documents = _documents(sequences, seq_len=seq_len, vocab_size=model.cfg.vocab_size)
  plan = packing.plan(np.asarray([len(t) for t, _ in documents]), seq_len, strategy="ffd")
  graphdef, params = nnx.split(model)
  out: list[np.ndarray | None] = [None] * len(documents)
  num_rows = len(plan.row_splits) - 1
  for first in range(0, num_rows, batch_size):
    batch, where = _rows(documents, plan, range(first, min(first + batch_size, num_rows)),
                         seq_len)
    pad = batch_size - len(batch["input_ids"])
    batch = {k: np.pad(v, ((0, pad), (0, 0)), constant_values=IGNORE_INDEX if k == "labels"
                       else 0) for k, v in batch.items()}
    logp_BxS = np.asarray(_scored(graphdef, params, batch, block_size=block_size,
                                  temperature=float(temperature)))
    for doc, b, at, n in where:
      labelled = documents[doc][1] != IGNORE_INDEX
      out[doc] = logp_BxS[b, at:at + n][labelled]
  return out

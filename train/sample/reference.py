"""The full-forward decoder: the oracle of `train.rollout.engine` and the baseline of its benchmark.

Every new token recomputes the whole forward pass over the prompt and the tokens so far, as the
trainer computes it (`Decoder.__call__`, segment attention on one document), with no cache. The
row is `prompt + new tokens` as segment 1 at positions `0..n-1`, padded with segment 0 to a power
of two (`train.rollout.engine.bucket_length`) so that `jax.jit` compiles once per length bucket; the model
is causal and segment-masked, so the padding changes no logit of the document. Tokens are chosen
by `train.rollout.sampling.choose` with the same per-completion keys, so both decoders draw the
same tokens from the same logits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from train.rollout import engine
from train.rollout import sampling as sampling_lib
from train.model import decoder as model_lib


def padded_row(tokens: Sequence[int], *, length: int) -> dict[str, np.ndarray]:
  """`tokens` as the one document of a `[1, length]` row: `input_ids`, `segment_ids` (1, then 0
  on the padding) and `segment_positions` (0..n-1, then 0)."""
  n = len(tokens)
  if n > length:
    raise ValueError(f"padded_row: {n} tokens do not fit in length={length}")
  input_ids_1xS = np.zeros((1, length), np.int32)
  input_ids_1xS[0, :n] = tokens
  segment_ids_1xS = (np.arange(length) < n).astype(np.int32)[None]
  segment_positions_1xS = np.where(segment_ids_1xS[0] > 0, np.arange(length), 0)[None]
  return dict(input_ids=input_ids_1xS, segment_ids=segment_ids_1xS,
              segment_positions=segment_positions_1xS.astype(np.int32))


@functools.partial(jax.jit, static_argnums=0)
def _logits_at(graphdef: Any, params: Any, row: dict[str, jax.Array],
               index: jax.Array) -> jax.Array:
  """The logits `[V]` at slot `index` of a `[1, S]` row (the training forward pass)."""
  model = nnx.merge(graphdef, params)
  logits_1xSxV = model(row["input_ids"], segment_ids=row["segment_ids"],
                       segment_positions=row["segment_positions"])
  return logits_1xSxV[0, index]


def last_logits(model: model_lib.Decoder, tokens: Sequence[int]) -> jax.Array:
  """The logits `[V]` after the last of `tokens` (one document, padded to a bucket)."""
  graphdef, params = nnx.split(model)
  row = padded_row(tokens, length=engine.bucket_length(len(tokens)))
  return _logits_at(graphdef, params, row, jnp.int32(len(tokens) - 1))


def generate(model: model_lib.Decoder, prompt: Sequence[int], *, max_new_tokens: int,
             sampling: sampling_lib.Sampling = sampling_lib.GREEDY, seed: int = 0,
             prompt_index: int = 0, sample_index: int = 0, stop_ids: Sequence[int] = (),
             max_len: int | None = None) -> tuple[list[int], list[float]]:
  """Continues one prompt, one full forward pass per new token.

  Args:
    model: the decoder.
    prompt: token ids (BOS included if the run's documents began with one).
    max_new_tokens: the most tokens to add.
    sampling: as `train.rollout.engine.generate`.
    seed: as `train.rollout.engine.generate`.
    prompt_index: the prompt's index in a `generate` call (its draws' key).
    sample_index: the completion's index among the prompt's samples (its draws' key).
    stop_ids: stop after one of these.
    max_len: prompt and new tokens never exceed it.

  Returns:
    `(the new tokens, ending with the stop id when one was drawn, their log-probs at the
    sampling temperature)`.
  """
  (tokens,) = engine.check_prompts([prompt], vocab_size=model.cfg.vocab_size,
                                   max_new_tokens=max_new_tokens, max_len=max_len)
  key = sampling_lib.completion_key(seed, prompt_index, sample_index)
  new, logprobs = [], []
  while len(new) < max_new_tokens and (max_len is None or len(tokens) < max_len):
    token, logprob, _ = sampling_lib.choose(last_logits(model, tokens),
                                            jax.random.fold_in(key, len(new)), sampling)
    tokens.append(int(token))
    new.append(int(token))
    logprobs.append(float(logprob))
    if int(token) in stop_ids:
      break
  return new, logprobs

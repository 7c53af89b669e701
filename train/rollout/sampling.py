"""How a completion's next token is chosen, and the two log-probs every chosen token carries.

A draw applies temperature, then top-k, then top-p to the float32 logits (transformers' order)
and draws from what is left, renormalised. Every token comes with:

  1. `logprob`: its log-prob under the model at the sampling temperature over the whole
     vocabulary, `log_softmax(logits / T)[token]` (T = 1 for greedy choice, where the
     temperature is 0): what the trainer's scoring pass computes for the same sequence
     (`train.rollout.logprobs.sequence_logprobs`) and what an RL objective's ratio starts from.
  2. `sampling_logprob`: its log-prob under the distribution actually drawn from, top-k and
     top-p's kept tokens renormalised, `log_softmax(where(kept, logits / T, -inf))[token]`
     (0 for greedy choice: a point mass). The two differ exactly by the log of the kept mass.

Example: logits `[2, 1, 0]`, temperature 1, top_k 2: the kept tokens 0 and 1 are drawn with
probabilities `[0.73, 0.27]`; a draw of token 1 has `logprob = log 0.245 = -1.41` and
`sampling_logprob = log 0.269 = -1.31`.

Draws are keyed by completion: `completion_key(seed, prompt, sample)`, folded with the token's
index, so a completion's tokens depend on the seed, its prompt's index, its sample index and
nothing else (not on the lanes, the other prompts or the order of the work).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from segpack.errors import UserError


class DecodeError(UserError, ValueError):
  """Prompts or settings that cannot be decoded (printed as one line by `train.sample`)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen from the logits.

  Attributes:
    temperature: divides the logits before a draw; 0 chooses greedily (argmax).
    top_k: draw among the `top_k` most likely tokens (0: all); 1 is greedy.
    top_p: draw among the most likely tokens whose probabilities (after temperature and top-k)
      sum to at least `top_p` (nucleus sampling; 1.0: all).
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
      raise DecodeError(f"temperature must be a number >= 0, got {self.temperature!r}")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise DecodeError(f"top_k must be an int >= 0, got {self.top_k!r}")
    if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
      raise DecodeError(f"top_p must be in (0, 1], got {self.top_p!r}")
    if not np.float32(self.top_p) >= np.finfo(np.float32).tiny:  # compared in float32
      raise DecodeError(f"top_p must be in (0, 1] and at least {np.finfo(np.float32).tiny:.3g} "
                        f"(it rounds to 0 or a subnormal in float32), got {self.top_p!r}")

  @property
  def greedy(self) -> bool:
    """Whether every lane takes its argmax (temperature 0 or top_k 1)."""
    return self.temperature == 0 or self.top_k == 1

  @property
  def logprob_temperature(self) -> float:
    """The temperature of `logprob`: the sampling temperature, 1 for greedy choice."""
    return 1.0 if self.temperature == 0 else float(self.temperature)


GREEDY = Sampling()


def completion_key(seed: jax.Array | int, prompt: jax.Array | int,
                   sample: jax.Array | int) -> jax.Array:
  """The key of one completion's draws (its token `t` draws with `fold_in(key, t)`)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), prompt), sample)


def kept_logits(logits_V: jax.Array, sampling: Sampling) -> jax.Array:
  """`logits / temperature` with the tokens top-k and top-p drop set to -inf (float32)."""
  logits_V = logits_V.astype(jnp.float32) / sampling.logprob_temperature
  if sampling.top_k:
    kth = jax.lax.top_k(logits_V, min(sampling.top_k, logits_V.shape[-1]))[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  if sampling.top_p < 1:
    sorted_V = jnp.sort(logits_V)[::-1]
    probs_V = jax.nn.softmax(sorted_V)
    kept = (jnp.cumsum(probs_V) - probs_V) < sampling.top_p
    cutoff = sorted_V[jnp.maximum(jnp.sum(kept), 1) - 1]  # the most likely token always survives
    logits_V = jnp.where(logits_V < cutoff, -jnp.inf, logits_V)
  return logits_V


def choose(logits_V: jax.Array, key: jax.Array, sampling: Sampling
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`(token, logprob, sampling_logprob)` of one lane's next token (see the module docstring)."""
  full_V = jax.nn.log_softmax(logits_V.astype(jnp.float32) / sampling.logprob_temperature)
  if sampling.greedy:
    token = jnp.argmax(logits_V).astype(jnp.int32)
    return token, full_V[token], jnp.float32(0.0)
  drawn_V = jax.nn.log_softmax(kept_logits(logits_V, sampling))
  token = jax.random.categorical(key, drawn_V).astype(jnp.int32)
  return token, full_V[token], drawn_V[token]

"""KV-cache decoding of a `train.model.decoder.Decoder` on packed rows, in one jitted loop.

Prompts are packed into rows as the trainer packs documents (segment ids 1..n, positions from 0 in
every segment), and every prompt is one *lane* of its row. Keys and values of every layer are kept
in a cache of `T = P + M * N` slots per row (`P` prompt slots, `M` new tokens of the `N` lanes of a
row, `M` the most any lane has room for: `max_new_tokens`, cut at `max_len` less its prompt), and each cache slot carries its lane's segment id and its slot index, so that attention is
`segpack.attention.xla.segment_attention_xla_slots`: a query sees the slots of its own segment up
to its own. A prompt therefore decodes exactly as it would alone, whichever prompts share its row.

Algorithm (`decode`):
  1. Lay the prompts out (`layout_prompts`): longest first, each into the row holding the fewest
     tokens; the prompt part is padded to a power of two (at least 16) so that `jax.jit` compiles
     once per length bucket.
  2. Prefill: one forward pass over the `[B, P]` prompt rows writes slots `0..P-1` of the cache;
     the logits at each lane's last prompt token choose its first new token.
  3. Decode (`lax.while_loop`): step `t` feeds the `[B, N]` tokens chosen at `t - 1`, at position
     `len(prompt) + t - 1`, writes their keys and values to slots `P + (t-1) * N + lane`, and
     chooses token `t` of every lane; a lane stops at a stop id, at its room (`max_len`) or after
     `M` tokens, and the loop ends when every lane has stopped.

Example: prompts `[a b c]` and `[d e]` in one row give the prompt row `[a b c d e pad...]` with
segment ids `[1 1 1 2 2 0...]`; at step 1, lane 1 feeds its token at position 3 into slot `P`
and lane 2 at position 2 into slot `P + 1`; lane 2's query sees `d e` and slot `P + 1` only.

Token choice (`Sampling`): greedy argmax, or a draw after temperature, top-k and top-p (in this
order, as transformers applies them). Lane draws use `fold_in(fold_in(key(seed), prompt), t)`:
a prompt draws the same tokens wherever it is laid out.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from segpack.attention import xla as attention_xla
from segpack.errors import UserError
from train.model import config as model_config
from train.model import decoder as model_lib
from train.model import rope as rope_lib

MIN_BUCKET = 16  # the shortest padded prompt part


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


GREEDY = Sampling()


def lane_key(seed: int, prompt: int) -> jax.Array:
  """The key of one prompt's draws (step `t` draws with `fold_in(lane_key, t)`)."""
  return jax.random.fold_in(jax.random.key(seed), prompt)


def choose(logits_V: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """The next token of one lane: argmax when `sampling.greedy`, else a draw from the logits
  after temperature, top-k and top-p."""
  if sampling.greedy:
    return jnp.argmax(logits_V).astype(jnp.int32)
  logits_V = logits_V / sampling.temperature
  if sampling.top_k:
    kth = jax.lax.top_k(logits_V, min(sampling.top_k, logits_V.shape[-1]))[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  if sampling.top_p < 1:
    sorted_V = jnp.sort(logits_V)[::-1]
    probs_V = jax.nn.softmax(sorted_V)
    kept = (jnp.cumsum(probs_V) - probs_V) < sampling.top_p
    cutoff = sorted_V[jnp.maximum(jnp.sum(kept), 1) - 1]  # the most likely token always survives
    logits_V = jnp.where(logits_V < cutoff, -jnp.inf, logits_V)
  return jax.random.categorical(key, logits_V).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Prompts packed into `B` rows of `N` lanes (step 1 of `decode`); all NumPy.

  Attributes:
    input_ids_BxP: the prompt rows, padded with 0.
    segment_ids_BxP: lane `j` of a row is segment `j + 1`; 0 on the padding.
    segment_positions_BxP: 0.. in every segment.
    prompt_BxN: the prompt index of each lane (-1: an empty lane).
    length_BxN: each lane's prompt length (0 for an empty lane).
    last_slot_BxN: the slot of each lane's last prompt token (0 for an empty lane).
  """

  input_ids_BxP: np.ndarray
  segment_ids_BxP: np.ndarray
  segment_positions_BxP: np.ndarray
  prompt_BxN: np.ndarray
  length_BxN: np.ndarray
  last_slot_BxN: np.ndarray


def bucket_length(length: int) -> int:
  """The next power of two, at least `MIN_BUCKET`."""
  return max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length())


def layout_prompts(prompts: Sequence[Sequence[int]], *, rows: int) -> Layout:
  """Packs `prompts` into `rows` rows: longest first, each into the row with the fewest tokens
  (the lowest index on ties); within a row, lanes in prompt order."""
  if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= len(prompts):
    raise DecodeError(f"rows must be an int in [1, {len(prompts)}] (the number of prompts), "
                      f"got {rows!r}")
  members: list[list[int]] = [[] for _ in range(rows)]
  filled = [0] * rows
  for i in sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i)):
    row = min(range(rows), key=lambda r: (filled[r], r))
    members[row].append(i)
    filled[row] += len(prompts[i])
  lanes, p = max(len(m) for m in members), bucket_length(max(filled))
  out = dict(input_ids_BxP=np.zeros((rows, p), np.int32),
             segment_ids_BxP=np.zeros((rows, p), np.int32),
             segment_positions_BxP=np.zeros((rows, p), np.int32),
             prompt_BxN=np.full((rows, lanes), -1, np.int32),
             length_BxN=np.zeros((rows, lanes), np.int32),
             last_slot_BxN=np.zeros((rows, lanes), np.int32))
  for row, indices in enumerate(members):
    start = 0
    for lane, i in enumerate(sorted(indices)):
      n = len(prompts[i])
      out["input_ids_BxP"][row, start:start + n] = prompts[i]
      out["segment_ids_BxP"][row, start:start + n] = lane + 1
      out["segment_positions_BxP"][row, start:start + n] = np.arange(n)
      out["prompt_BxN"][row, lane], out["length_BxN"][row, lane] = i, n
      out["last_slot_BxN"][row, lane] = start + n - 1
      start += n
  return Layout(**out)


def _layers(model: model_lib.Decoder, x_BxQxE: jax.Array, positions_BxQ: jax.Array,
            segment_ids_BxQ: jax.Array, slots_BxQ: jax.Array, cache: jax.Array,
            cache_segment_ids_BxT: jax.Array, write_at: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The blocks of `model` on `Q` new slots per row: each layer writes their keys and values into
  `cache[layer]` at slot `write_at` and attends over the cache. Returns the last block's output
  `[B, Q, E]` and the cache. The residual structure is `train.model.decoder.Block`'s."""
  cfg = model.cfg
  b, q, _ = x_BxQxE.shape
  angles_BxQxD2 = rope_lib.rope_angles(positions_BxQ, head_dim=cfg.head_dim, theta=cfg.rope_theta,
                                       scaling=cfg.rope_scaling)
  slots_BxT = jnp.broadcast_to(jnp.arange(cache.shape[3]), cache_segment_ids_BxT.shape)
  for layer, block in enumerate(model.layers):
    q_BxQxHxD, k_BxQxKxD, v_BxQxKxD = block.attn.qkv(block.attn_norm(x_BxQxE), angles_BxQxD2)
    kv_2xBxQxKxD = jnp.stack([k_BxQxKxD, v_BxQxKxD]).astype(cache.dtype)
    cache = jax.lax.dynamic_update_slice(cache, kv_2xBxQxKxD[None], (layer, 0, 0, write_at, 0, 0))
    out_BxQxHxD = attention_xla.segment_attention_xla_slots(
        q_BxQxHxD, cache[layer, 0], cache[layer, 1], segment_ids_BxQ, cache_segment_ids_BxT,
        slots_BxQ, slots_BxT, causal=True, scale=float(cfg.head_dim) ** -0.5)
    x_BxQxE = x_BxQxE + block.attn.o(out_BxQxHxD.reshape(b, q, cfg.num_heads * cfg.head_dim))
    x_BxQxE = x_BxQxE + block.mlp(block.mlp_norm(x_BxQxE))
  return x_BxQxE, cache


def _choose_lanes(logits_BxNxV: jax.Array, keys_BxN: jax.Array, step: jax.Array,
                  sampling: Sampling) -> jax.Array:
  """`choose` for every lane, lane keys folded with the step."""
  def one(logits_V, key):
    return choose(logits_V, jax.random.fold_in(key, step), sampling)
  return jax.vmap(jax.vmap(one))(logits_BxNxV, keys_BxN)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "sampling"))
def _decode(graphdef: Any, params: Any, rows: dict[str, jax.Array], stop_ids: jax.Array,
            seed: jax.Array, *, max_new: int, sampling: Sampling) -> jax.Array:
  """Steps 2 and 3 of `decode`: the new tokens `[B, N, M]` of every lane (-1 after its end)."""
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  seg_BxP, lanes_BxN = rows["segment_ids_BxP"], rows["prompt_BxN"]
  (b, p), n = seg_BxP.shape, lanes_BxN.shape[1]
  lane_seg_BxN = jnp.where(lanes_BxN >= 0, jnp.arange(1, n + 1)[None], 0)
  cache_seg_BxT = jnp.concatenate([seg_BxP, jnp.tile(lane_seg_BxN, (1, max_new))], axis=1)
  cache = jnp.zeros((cfg.num_layers, 2, b, p + max_new * n, cfg.num_kv_heads, cfg.head_dim),
                    model_config.DTYPES[cfg.dtype])
  keys_BxN = jax.vmap(jax.vmap(lambda i: lane_key(seed, i)))(lanes_BxN)
  x_BxPxE, cache = _layers(model, model.embed_tokens(rows["input_ids_BxP"]),
                           rows["segment_positions_BxP"], seg_BxP,
                           jnp.broadcast_to(jnp.arange(p), (b, p)), cache, cache_seg_BxT, 0)
  last_BxNxE = jnp.take_along_axis(x_BxPxE, rows["last_slot_BxN"][:, :, None], axis=1)
  token_BxN = _choose_lanes(model.head(last_BxNxE), keys_BxN, 0, sampling)
  room_BxN = rows["room_BxN"]
  done_BxN = jnp.isin(token_BxN, stop_ids) | (room_BxN <= 1) | (lanes_BxN < 0)
  out_BxNxM = jnp.full((b, n, max_new), -1, jnp.int32).at[:, :, 0].set(
      jnp.where(lanes_BxN >= 0, token_BxN, -1))

  def running(carry):
    t, _, done_BxN, _, _ = carry
    return (t < max_new) & ~jnp.all(done_BxN)

  def step(carry):
    t, token_BxN, done_BxN, out_BxNxM, cache = carry
    write_at = p + (t - 1) * n
    x_BxNxE, cache = _layers(model, model.embed_tokens(token_BxN), rows["length_BxN"] + t - 1,
                             lane_seg_BxN, write_at + jnp.broadcast_to(jnp.arange(n), (b, n)),
                             cache, cache_seg_BxT, write_at)
    new_BxN = _choose_lanes(model.head(x_BxNxE), keys_BxN, t, sampling)
    out_BxNxM = out_BxNxM.at[:, :, t].set(jnp.where(done_BxN, -1, new_BxN))
    done_BxN = done_BxN | jnp.isin(new_BxN, stop_ids) | (t + 1 >= room_BxN)
    return t + 1, new_BxN, done_BxN, out_BxNxM, cache

  carry = (jnp.int32(1), token_BxN, done_BxN, out_BxNxM, cache)
  return jax.lax.while_loop(running, step, carry)[3]


def check_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int, max_new_tokens: int,
                  max_len: int | None) -> list[list[int]]:
  """The prompts as lists of ints; raises DecodeError naming the prompt and the bad value."""
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
      max_new_tokens < 1):
    raise DecodeError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if not prompts:
    raise DecodeError("no prompt to decode: give at least one")
  out = []
  for i, prompt in enumerate(prompts):
    ids = [int(t) for t in prompt]
    if not ids:
      raise DecodeError(f"prompt {i} holds no token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
      raise DecodeError(f"prompt {i}: token ids must lie in [0, {vocab_size}), got {bad[:8]}")
    if max_len is not None and len(ids) >= max_len:
      raise DecodeError(f"prompt {i} has {len(ids)} tokens: no room for a new one in the "
                        f"model's {max_len} positions")
    out.append(ids)
  return out


def lane_rooms(length_BxN: np.ndarray, *, max_new_tokens: int,
               max_len: int | None) -> np.ndarray:
  """The most new tokens of each lane: `max_new_tokens`, cut where its prompt and new tokens
  fill `max_len` positions (computed in Python ints first, so any `max_new_tokens` fits int32)."""
  bound = max_new_tokens if max_len is None else min(max_new_tokens, max_len)
  if bound > np.iinfo(np.int32).max:
    raise DecodeError(f"max_new_tokens must be at most {np.iinfo(np.int32).max} without a "
                      f"max_len, got {max_new_tokens!r}")
  room_BxN = np.full_like(length_BxN, bound)
  return room_BxN if max_len is None else np.minimum(room_BxN, max_len - length_BxN)


def decode(model: model_lib.Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
           sampling: Sampling = GREEDY, seed: int = 0, stop_ids: Sequence[int] = (),
           rows: int | None = None, max_len: int | None = None) -> list[list[int]]:
  """Continues every prompt (see the module docstring); one compiled loop for all of them.

  Args:
    model: the decoder (any attention backend: decoding runs the XLA math on the cache, on one
      device; parameters placed on a mesh are copied there).
    prompts: token ids of each prompt, as the model should see them (BOS included if the run's
      documents began with one).
    max_new_tokens: the most tokens added to each prompt; any int >= 1: the loop and the
      KV cache are sized to what can be generated (`max_len` less the prompt).
    sampling: greedy (default) or a draw (`Sampling`).
    seed: the seed of the draws (prompt `i`, step `t`: `fold_in(lane_key(seed, i), t)`).
    stop_ids: a lane stops after drawing one of these (EOS, the template's end of turn).
    rows: rows to pack the prompts into (default: one row per prompt).
    max_len: the model's positions (`packing.seq_len` or the context length): prompt and new
      tokens never exceed it.

  Returns:
    The new tokens of each prompt, in prompt order, ending with the stop id when one was drawn.

  Raises:
    DecodeError: an empty prompt, ids outside the vocabulary, no room, bad settings.
  """
  prompts = check_prompts(prompts, vocab_size=model.cfg.vocab_size,
                          max_new_tokens=max_new_tokens, max_len=max_len)
  layout = layout_prompts(prompts, rows=len(prompts) if rows is None else rows)
  room_BxN = lane_rooms(layout.length_BxN, max_new_tokens=max_new_tokens, max_len=max_len)
  max_new = int(room_BxN[layout.prompt_BxN >= 0].max())  # the cache holds what can be generated
  arrays = dict(dataclasses.asdict(layout), room_BxN=room_BxN)
  graphdef, params = nnx.split(model)
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = jax.device_put(params, one_device)  # parameters placed on a mesh come to one device
  out_BxNxM = np.asarray(_decode(
      graphdef, params, {k: jnp.asarray(v) for k, v in arrays.items()},
      jnp.asarray(list(stop_ids) or [-2], jnp.int32), jnp.int32(seed),
      max_new=max_new, sampling=sampling))
  results: list[list[int]] = [[] for _ in prompts]
  for (row, lane), i in np.ndenumerate(layout.prompt_BxN):
    if i >= 0:
      tokens = out_BxNxM[row, lane]
      results[i] = [int(t) for t in tokens[tokens >= 0]]
  return results

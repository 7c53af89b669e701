"""The rollout engine's device side: a KV cache of prompt groups and completion lanes, and the
three jitted programs that change it (prefill, start, decode steps).

The cache holds, for every layer:

  - `G` *prompt groups* of `P` slots (`prompt_kv`): a prompt's keys and values, written once by
    its prefill and read by every lane decoding a completion of it;
  - `L` *lanes* of `M` slots (`lane_kv`): the keys and values of one completion's own tokens.

A lane's query at its token `t` attends to its group's first `len(prompt)` slots and its own
slots `0..t`; nothing else is visible, so a completion decodes exactly as it would alone, the
prompt's slots are stored once however many completions share it, and a lane that finished is
given the next completion without touching the others. Every array keeps its shape from the first
program to the last: each program compiles once (the prefill once per row count it is called
with).

Example: G = 2, L = 3, prompts `a` (3 tokens) and `b` (2 tokens), two samples each. Groups 0 and
1 hold `a` and `b`; lanes 0, 1 decode `a`'s samples, lane 2 `b`'s first. When lane 0 ends, it
takes `b`'s second sample: its query sees group 1's slots 0..1 and its own slots from 0.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from segpack.attention import xla as attention_xla
from train.model import config as model_config
from train.model import decoder as model_lib
from train.model import rope as rope_lib
from train.rollout import sampling as sampling_lib

# A lane's finish reasons, as the cache records them (0: running or idle).
RUNNING, STOP_ID, LENGTH, ROOM = 0, 1, 2, 3


def init_state(cfg: Any, *, groups: int, prompt_slots: int, lanes: int,
               new_slots: int) -> dict[str, jax.Array]:
  """An empty cache: `G` groups of `P` slots, `L` lanes of `M` slots, every lane idle."""
  dtype = model_config.DTYPES[cfg.dtype]
  kv = (cfg.num_layers, 2)
  heads = (cfg.num_kv_heads, cfg.head_dim)
  return dict(
      prompt_kv=jnp.zeros(kv + (groups, prompt_slots) + heads, dtype),
      lane_kv=jnp.zeros(kv + (lanes, new_slots) + heads, dtype),
      group_len=jnp.zeros((groups,), jnp.int32),
      group_logits=jnp.zeros((groups, cfg.vocab_size), jnp.float32),
      **{name: jnp.zeros((lanes,), jnp.int32) for name in (  # one buffer each: all donated
          "lane_group", "lane_prompt", "lane_sample", "lane_room", "lane_full", "lane_t",
          "lane_reason")},
      lane_active=jnp.zeros((lanes,), bool),
      steps=jnp.zeros((), jnp.int32),  # decode steps taken (the lanes' utilization)
      tokens=jnp.full((lanes, new_slots), -1, jnp.int32),
      logprobs=jnp.zeros((lanes, new_slots), jnp.float32),
      sampling_logprobs=jnp.zeros((lanes, new_slots), jnp.float32))


def _block_attend(block: Any, x_BxQxE: jax.Array, angles: jax.Array, attend: Any) -> jax.Array:
  """One decoder block (`train.model.decoder.Block`'s residual structure) whose attention is
  `attend(q, k, v) -> out`, which also stores `k` and `v` where they belong."""
  cfg = block.attn.cfg
  b, q, _ = x_BxQxE.shape
  q_BxQxHxD, k_BxQxKxD, v_BxQxKxD = block.attn.qkv(block.attn_norm(x_BxQxE), angles)
  out_BxQxHxD = attend(q_BxQxHxD, k_BxQxKxD, v_BxQxKxD)
  x_BxQxE = x_BxQxE + block.attn.o(out_BxQxHxD.reshape(b, q, cfg.num_heads * cfg.head_dim))
  return x_BxQxE + block.mlp(block.mlp_norm(x_BxQxE))


def _angles(model: model_lib.Decoder, positions_BxQ: jax.Array) -> jax.Array:
  cfg = model.cfg
  return rope_lib.rope_angles(positions_BxQ, head_dim=cfg.head_dim, theta=cfg.rope_theta,
                              scaling=cfg.rope_scaling)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def prefill(graphdef: Any, params: Any, state: dict[str, jax.Array], ids_RxP: jax.Array,
            length_R: jax.Array, group_R: jax.Array) -> dict[str, jax.Array]:
  """Writes `R` prompts (one per row, padded) into groups `group_R` (an index `>= G` drops the
  row: padding of the call), their lengths and the logits after their last token."""
  model = nnx.merge(graphdef, params)
  r, p = ids_RxP.shape
  slots_RxP = jnp.broadcast_to(jnp.arange(p), (r, p))
  seg_RxP = (slots_RxP < length_R[:, None]).astype(jnp.int32)
  scale = float(model.cfg.head_dim) ** -0.5
  kv = []

  def attend(q, k, v):
    kv.append(jnp.stack([k, v]))
    return attention_xla.segment_attention_xla_slots(q, k, v, seg_RxP, seg_RxP, slots_RxP,
                                                     slots_RxP, causal=True, scale=scale)

  x_RxPxE = model.embed_tokens(ids_RxP)
  angles = _angles(model, slots_RxP)
  for block in model.layers:
    x_RxPxE = _block_attend(block, x_RxPxE, angles, attend)
  last_Rx1xE = jnp.take_along_axis(x_RxPxE, jnp.maximum(length_R - 1, 0)[:, None, None], axis=1)
  logits_RxV = model.head(last_Rx1xE)[:, 0].astype(jnp.float32)
  kv_Lx2xRxPxKxD = jnp.stack(kv).astype(state["prompt_kv"].dtype)
  state = dict(state)
  state["prompt_kv"] = state["prompt_kv"].at[:, :, group_R].set(kv_Lx2xRxPxKxD, mode="drop")
  state["group_len"] = state["group_len"].at[group_R].set(length_R, mode="drop")
  state["group_logits"] = state["group_logits"].at[group_R].set(logits_RxV, mode="drop")
  return state


def _record(state: dict[str, jax.Array], logits_LxV: jax.Array, stop_ids: jax.Array,
            seed: jax.Array, recording_L: jax.Array, sampling: sampling_lib.Sampling
            ) -> dict[str, jax.Array]:
  """Chooses token `lane_t` of every lane that is `recording_L` from its logits, records it with
  its log-probs, and ends the lanes it finishes (a stop id, their room, `max_new_tokens`)."""
  t_L = state["lane_t"]

  def one(logits_V, prompt, sample, t):
    return sampling_lib.choose(logits_V, jax.random.fold_in(
        sampling_lib.completion_key(seed, prompt, sample), t), sampling)

  token_L, logp_L, logq_L = jax.vmap(one)(logits_LxV, state["lane_prompt"],
                                          state["lane_sample"], t_L)
  lanes = jnp.arange(t_L.shape[0])
  at = jnp.where(recording_L, t_L, state["tokens"].shape[1])  # out of range: dropped
  state = dict(state)
  for name, value in (("tokens", token_L), ("logprobs", logp_L), ("sampling_logprobs", logq_L)):
    state[name] = state[name].at[lanes, at].set(value, mode="drop")
  stopped_L = jnp.isin(token_L, stop_ids)
  full_L = t_L + 1 >= state["lane_room"]
  reason_L = jnp.where(stopped_L, STOP_ID, jnp.where(full_L, state["lane_full"], RUNNING))
  ended_L = recording_L & (reason_L != RUNNING)
  state["lane_reason"] = jnp.where(recording_L, reason_L, state["lane_reason"])
  state["lane_active"] = state["lane_active"] & ~ended_L
  state["lane_t"] = jnp.where(recording_L, t_L + 1, t_L)
  return state


@functools.partial(jax.jit, static_argnames=("sampling",), donate_argnames=("state",))
def start(state: dict[str, jax.Array], new_L: jax.Array, group_L: jax.Array, prompt_L: jax.Array,
          sample_L: jax.Array, room_L: jax.Array, full_reason_L: jax.Array, stop_ids: jax.Array,
          seed: jax.Array, *, sampling: sampling_lib.Sampling) -> dict[str, jax.Array]:
  """Gives the lanes `new_L` their completions (group, prompt and sample index, room, and the
  reason they end at their room: `LENGTH` or `ROOM`) and chooses their first tokens from the
  group's prefill logits."""
  state = dict(state)
  for name, value in (("lane_group", group_L), ("lane_prompt", prompt_L),
                      ("lane_sample", sample_L), ("lane_room", room_L),
                      ("lane_full", full_reason_L)):
    state[name] = jnp.where(new_L, value, state[name])
  state["lane_t"] = jnp.where(new_L, 0, state["lane_t"])
  state["lane_reason"] = jnp.where(new_L, RUNNING, state["lane_reason"])
  state["lane_active"] = state["lane_active"] | new_L
  logits_LxV = state["group_logits"][state["lane_group"]]
  return _record(state, logits_LxV, stop_ids, seed, new_L, sampling)


def _lane_step(model: model_lib.Decoder, state: dict[str, jax.Array], stop_ids: jax.Array,
               seed: jax.Array, sampling: sampling_lib.Sampling) -> dict[str, jax.Array]:
  """One token for every active lane: feeds its last token, stores its keys and values in its
  own slot `t - 1`, attends to its group's prompt and its own slots `0..t-1`."""
  group_L, t_L, active_L = state["lane_group"], state["lane_t"], state["lane_active"]
  lanes, m = t_L.shape[0], state["lane_kv"].shape[3]
  write_L = jnp.clip(t_L - 1, 0, m - 1)
  last_L = state["tokens"][jnp.arange(lanes), write_L]
  len_L = state["group_len"][group_L]
  p = state["prompt_kv"].shape[3]
  seen_prompt_LxP = jnp.arange(p)[None] < len_L[:, None]
  seen_own_LxM = jnp.arange(m)[None] <= write_L[:, None]
  seg_k_LxT = jnp.concatenate([seen_prompt_LxP, seen_own_LxM], axis=1).astype(jnp.int32)
  seg_q_Lx1 = active_L[:, None].astype(jnp.int32)
  slots_LxT = jnp.zeros_like(seg_k_LxT)
  scale = float(model.cfg.head_dim) ** -0.5
  lane_kv = state["lane_kv"]
  prompt_kv = state["prompt_kv"]
  layer = [0]

  def attend(q_Lx1xHxD, k_Lx1xKxD, v_Lx1xKxD):
    nonlocal lane_kv
    i = layer[0]
    layer[0] += 1
    for j, new in enumerate((k_Lx1xKxD, v_Lx1xKxD)):
      lane_kv = lane_kv.at[i, j, jnp.arange(lanes), write_L].set(new[:, 0].astype(lane_kv.dtype))
    keys, values = (jnp.concatenate([prompt_kv[i, j][group_L], lane_kv[i, j]], axis=1)
                    for j in (0, 1))
    return attention_xla.segment_attention_xla_slots(
        q_Lx1xHxD, keys, values, seg_q_Lx1, seg_k_LxT, slots_LxT[:, :1], slots_LxT,
        causal=False, scale=scale)

  x_Lx1xE = model.embed_tokens(last_L[:, None])
  angles = _angles(model, (len_L + t_L - 1)[:, None])
  for block in model.layers:
    x_Lx1xE = _block_attend(block, x_Lx1xE, angles, attend)
  logits_LxV = model.head(x_Lx1xE)[:, 0].astype(jnp.float32)
  state = dict(state, lane_kv=lane_kv)
  return _record(state, logits_LxV, stop_ids, seed, active_L, sampling)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("state",))
def steps(graphdef: Any, params: Any, state: dict[str, jax.Array], stop_ids: jax.Array,
          seed: jax.Array, max_steps: jax.Array, until_ended: jax.Array, *,
          sampling: sampling_lib.Sampling) -> dict[str, jax.Array]:
  """Decode steps until no lane is active, `max_steps` were taken, or `until_ended` lanes
  ended (0: never; the host asks for it when completions wait for lanes)."""
  model = nnx.merge(graphdef, params)
  active_at_start = state["lane_active"]

  def running(carry):
    n, state = carry
    ended = jnp.sum(active_at_start & ~state["lane_active"])
    return ((n < max_steps) & jnp.any(state["lane_active"])
            & ((until_ended == 0) | (ended < until_ended)))

  def step(carry):
    n, state = carry
    state = _lane_step(model, state, stop_ids, seed, sampling)
    return n + 1, dict(state, steps=state["steps"] + 1)

  return jax.lax.while_loop(running, step, (jnp.int32(0), state))[1]


@functools.partial(jax.jit, donate_argnames=("state",))
def cancel(state: dict[str, jax.Array], ended_L: jax.Array) -> dict[str, jax.Array]:
  """Ends the lanes `ended_L` (a stop string found on the host)."""
  return dict(state, lane_active=state["lane_active"] & ~ended_L)

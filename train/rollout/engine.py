"""The rollout engine: `n` completions of every prompt from one prefill, lanes reused as they
finish, every token with its two log-probs.

Algorithm (`generate`):
  1. The work is every `(prompt, sample)` pair, prompt by prompt. The cache
     (`train.rollout.cache`) has `lanes` lanes and `min(prompts, lanes + PREFILL_ROWS)` prompt
     groups (a group holds a prompt from its prefill until its last completion ends).
  2. Refill: each idle lane takes the next waiting completion. A prompt that is not in a group
     yet is prefilled into a free one (one forward pass over its padded row); once
     `PREFILL_ROWS` groups are free, the next prompts are prefilled ahead into them in one call.
     A prompt's completions all read its group, however many there are.
  3. Decode steps run on the device until `lanes / REFILL_SHARE` lanes have ended while
     completions still wait (every lane, once none waits; with stop strings, at most
     `steps_per_check` steps), then the host takes the ended lanes' tokens, looks for stop
     strings in the lanes still running, frees the lanes and groups that are done, and goes
     back to step 2. Lanes never wait for the longest completion of a batch.
  4. A completion ends at a stop id (kept as its last token), a stop string (the completion is
     cut after the token that completed it; `text` stops before the string), `max_new_tokens`
     (`"length"`) or the model's positions (`"room"`: prompt and completion fill `max_len`).

Example: prompts `a`, `b` with `num_samples=2` on 2 lanes: lanes 0 and 1 decode `(a, 0)` and
`(a, 1)` from one prefill of `a`; when `(a, 1)` ends, lane 1 takes `(b, 0)` after `b`'s prefill,
lane 0 still decoding; and so on until the four completions are done.

The draws are keyed by `(seed, prompt, sample)` (`train.rollout.sampling`), so a completion is the
same whatever the lanes, the other prompts or the order in which the lanes took the work.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from train.model import config as model_config
from train.model import decoder as model_lib
from train.rollout import cache as cache_lib
from train.rollout import completion as completion_lib
from train.rollout.completion import Completion
from train.rollout.sampling import DecodeError, GREEDY, Sampling

MIN_BUCKET = 16  # the shortest padded prompt row
PREFILL_ROWS = 8  # prompts per prefill call when many wait (a single one is prefilled alone)
REFILL_SHARE = 8  # with completions waiting, the host refills once lanes / 8 lanes have ended
DEFAULT_LANES = 256  # the most completions decoded at once when `lanes` is not given


def bucket_length(length: int) -> int:
  """The next power of two, at least `MIN_BUCKET`."""
  return max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length())


def _positive_int(value: object, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise DecodeError(f"{name} must be an int >= 1, got {value!r}")
  return value


def check_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int,
                  max_new_tokens: int | Sequence[int], max_len: int | None) -> list[list[int]]:
  """The prompts as lists of ints; raises DecodeError naming the prompt and the bad value."""
  if not prompts:
    raise DecodeError("no prompt to decode: give at least one")
  if isinstance(max_new_tokens, (int, bool)) or max_new_tokens is None:
    _positive_int(max_new_tokens, "max_new_tokens")
  elif len(max_new_tokens) != len(prompts):
    raise DecodeError(f"max_new_tokens: one per prompt, got {len(max_new_tokens)} for "
                      f"{len(prompts)} prompts")
  else:
    for i, m in enumerate(max_new_tokens):
      _positive_int(m, f"max_new_tokens[{i}]")
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


def room(length: int, *, max_new_tokens: int, max_len: int | None) -> tuple[int, int]:
  """`(the most new tokens of a prompt of `length` tokens, the reason it ends there)`."""
  if max_len is not None and max_len - length < max_new_tokens:
    return max_len - length, cache_lib.ROOM
  if max_new_tokens > np.iinfo(np.int32).max:
    raise DecodeError(f"max_new_tokens must be at most {np.iinfo(np.int32).max} without a "
                      f"max_len, got {max_new_tokens!r}")
  return max_new_tokens, cache_lib.LENGTH


@dataclasses.dataclass
class _Work:
  """The host's view of the work (steps 1 to 3): what waits, which lane and group holds what."""

  prompts: list[list[int]]
  num_samples: int
  lanes: int
  groups: int
  rooms: list[tuple[int, int]]
  waiting: collections.deque = dataclasses.field(default_factory=collections.deque)
  lane_work: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
  group_of: dict[int, int] = dataclasses.field(default_factory=dict)
  left: dict[int, int] = dataclasses.field(default_factory=dict)
  checked: dict[int, int] = dataclasses.field(default_factory=dict)
  done: dict[tuple[int, int], Completion] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    self.waiting.extend((p, s) for p in range(len(self.prompts)) for s in range(self.num_samples))
    self.free_lanes = list(range(self.lanes))
    self.free_groups = list(range(self.groups))
    self.admitted = 0  # prompts 0..admitted-1 have had a group
    self.prefill_calls = 0

  def _admit(self, prefill: list[tuple[int, int]]) -> None:
    """The next prompt into a free group (prompts are admitted in order)."""
    p = self.admitted
    self.group_of[p] = self.free_groups.pop(0)
    self.left[p] = self.num_samples
    prefill.append((p, self.group_of[p]))
    self.admitted += 1

  def refill(self) -> tuple[list[tuple[int, int]], list[int]]:
    """Step 2 on the host: `(prompts to prefill as (prompt, group), lanes given work)`. Free
    groups are filled ahead with the next prompts once `PREFILL_ROWS` of them (or all the
    prompts left) are free, so that prefills run several prompts a call, not one per lane."""
    prefill, started = [], []
    while self.free_lanes and self.waiting:
      p, s = self.waiting[0]
      if p not in self.group_of:
        if not self.free_groups:
          break
        self._admit(prefill)
      self.waiting.popleft()
      lane = self.free_lanes.pop(0)
      self.lane_work[lane], self.checked[lane] = (p, s), 0
      started.append(lane)
    left = len(self.prompts) - self.admitted
    if left and len(self.free_groups) >= min(PREFILL_ROWS, left):
      while self.free_groups and self.admitted < len(self.prompts):
        self._admit(prefill)
    return prefill, started

  def release(self, lane: int, completion: Completion) -> None:
    """A lane's completion is done: the lane is free, and its group once the prompt's last
    completion is done."""
    p, s = self.lane_work.pop(lane)
    self.done[(p, s)] = completion
    self.free_lanes.append(lane)
    self.left[p] -= 1
    if not self.left[p]:
      self.free_groups.append(self.group_of.pop(p))


def _prefill(graphdef, params, state, work: _Work, prefill: list[tuple[int, int]],
             prompt_slots: int):
  """Step 2's prefills: one row per prompt, `PREFILL_ROWS` prompts per call (one alone)."""
  rows = 1 if len(prefill) == 1 else min(PREFILL_ROWS, work.groups)
  for at in range(0, len(prefill), rows):
    part = prefill[at:at + rows]
    ids_RxP = np.zeros((rows, prompt_slots), np.int32)
    length_R = np.ones((rows,), np.int32)
    group_R = np.full((rows,), work.groups, np.int32)  # out of range: a padding row, dropped
    for r, (p, g) in enumerate(part):
      ids_RxP[r, :len(work.prompts[p])] = work.prompts[p]
      length_R[r], group_R[r] = len(work.prompts[p]), g
    state = cache_lib.prefill(graphdef, params, state, jnp.asarray(ids_RxP),
                              jnp.asarray(length_R), jnp.asarray(group_R))
    work.prefill_calls += 1
  return state


def _start(state, work: _Work, started: list[int], stop_ids, seed, sampling: Sampling):
  """Step 2's new lanes: their completions, and their first tokens from the prefill logits."""
  arrays = {name: np.zeros((work.lanes,), np.int32)
            for name in ("group", "prompt", "sample", "room", "full")}
  new_L = np.zeros((work.lanes,), bool)
  for lane in started:
    p, s = work.lane_work[lane]
    new_L[lane] = True
    arrays["group"][lane], arrays["prompt"][lane], arrays["sample"][lane] = work.group_of[p], p, s
    arrays["room"][lane], arrays["full"][lane] = work.rooms[p]
  return cache_lib.start(state, jnp.asarray(new_L), *(jnp.asarray(arrays[k]) for k in (
      "group", "prompt", "sample", "room", "full")), stop_ids, seed, sampling=sampling)


def _collect(state, work: _Work, *, stops: list[str], detokenize: Callable[..., str] | None,
             stop_ids: Sequence[int]):
  """Step 3 on the host: the ended lanes' completions, the stop strings of the running ones."""
  active_L, t_L, reason_L = jax.device_get(
      (state["lane_active"], state["lane_t"], state["lane_reason"]))
  lanes = sorted(lane for lane in work.lane_work if stops or not active_L[lane])
  if not lanes:
    return state
  tokens, logp, logq = jax.device_get(tuple(state[k][np.asarray(lanes)] for k in (
      "tokens", "logprobs", "sampling_logprobs")))
  cancelled = np.zeros((work.lanes,), bool)
  for i, lane in enumerate(lanes):
    t = int(t_L[lane])
    found = (completion_lib.first_stop([int(x) for x in tokens[i, :t]], work.checked[lane],
                                       stops, detokenize) if stops else None)
    work.checked[lane] = t
    if found is not None:
      k, stop, cut = found
      cancelled[lane] = bool(active_L[lane])
      done = completion_lib.make(*work.lane_work[lane], tokens[i, :k], logp[i, :k],
                                 logq[i, :k], "stop_string", detokenize=detokenize,
                                 stop_ids=(), stop=stop, cut=cut)
    elif not active_L[lane]:
      done = completion_lib.make(*work.lane_work[lane], tokens[i, :t], logp[i, :t],
                                 logq[i, :t], completion_lib.FINISH_REASONS[int(reason_L[lane])],
                                 detokenize=detokenize, stop_ids=stop_ids)
    else:
      continue
    work.release(lane, done)
  return cache_lib.cancel(state, jnp.asarray(cancelled)) if cancelled.any() else state


def _make_work(prompts: Sequence[Sequence[int]], *, vocab_size: int, num_samples: int,
               max_new_tokens: int | Sequence[int], max_len: int | None,
               lanes: int | None) -> _Work:
  """Step 1: the prompts and settings checked, every completion's room, the lanes and groups."""
  prompts = check_prompts(prompts, vocab_size=vocab_size, max_new_tokens=max_new_tokens,
                          max_len=max_len)
  _positive_int(num_samples, "num_samples")
  total = len(prompts) * num_samples
  lanes = min(total, DEFAULT_LANES if lanes is None else _positive_int(lanes, "lanes"))
  asked = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
           else list(max_new_tokens))
  rooms = [room(len(p), max_new_tokens=m, max_len=max_len) for p, m in zip(prompts, asked)]
  return _Work(prompts=prompts, num_samples=num_samples, lanes=lanes,
               groups=min(len(prompts), lanes + PREFILL_ROWS), rooms=rooms)


def _cache_shape(work: _Work) -> dict[str, int]:
  """The cache's sizes: `work.groups` groups of the longest prompt's bucket, `work.lanes`
  lanes of the longest room."""
  return dict(groups=work.groups, prompt_slots=bucket_length(max(map(len, work.prompts))),
              lanes=work.lanes, new_slots=max(r for r, _ in work.rooms))


def cache_bytes(cfg: model_lib.DecoderConfig, prompts: Sequence[Sequence[int]], *,
                max_new_tokens: int | Sequence[int], num_samples: int = 1,
                max_len: int | None = None, lanes: int | None = None) -> dict[str, int]:
  """The bytes of the KV cache `generate` makes for these arguments: `prompt` (the groups'
  slots, once per prompt held) and `lanes` (the completions' own slots)."""
  work = _make_work(prompts, vocab_size=cfg.vocab_size, num_samples=num_samples,
                    max_new_tokens=max_new_tokens, max_len=max_len, lanes=lanes)
  shape = _cache_shape(work)
  per_slot = (cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
              * np.dtype(model_config.DTYPES[cfg.dtype]).itemsize)
  return dict(prompt=shape["groups"] * shape["prompt_slots"] * per_slot,
              lanes=shape["lanes"] * shape["new_slots"] * per_slot)


def generate(model: model_lib.Decoder, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int], num_samples: int = 1,
             sampling: Sampling = GREEDY,
             seed: int = 0, stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
             detokenize: Callable[[Sequence[int]], str] | None = None,
             max_len: int | None = None, lanes: int | None = None,
             steps_per_check: int = 8, stats: dict[str, int] | None = None
             ) -> list[Completion]:
  """`num_samples` completions of every prompt (see the module docstring).

  Args:
    model: the decoder (any attention backend: decoding runs the XLA math on the cache, on one
      device; parameters placed on a mesh are copied there).
    prompts: token ids of each prompt, as the model should see them (BOS included if the run's
      documents began with one).
    max_new_tokens: the most tokens of a completion (any int >= 1; the cache holds what fits),
      or one such bound per prompt (as lm-eval's requests each have their own).
    num_samples: completions per prompt, all from the prompt's one prefill (greedy choice gives
      `num_samples` equal ones).
    sampling: greedy (default) or a draw (`train.rollout.sampling.Sampling`).
    seed: the seed of the draws (`completion_key(seed, prompt, sample)`).
    stop_ids: a completion ends after one of these (EOS, the template's end of turn).
    stop_strings: a completion ends once its decoded text holds one of these (needs
      `detokenize`), as lm-eval's `until` and vLLM's `stop`.
    detokenize: token ids to text (the tokenizer's decode): the completions' `text`.
    max_len: the model's positions (`packing.seq_len` or the context length): prompt and new
      tokens never exceed it.
    lanes: completions decoded at once (default: all of them, at most `DEFAULT_LANES`); a lane
      that ends takes the next waiting completion.
    steps_per_check: with stop strings, decode steps between two looks at the text.
    stats: a dict that receives `lanes`, `decode_steps` and `prefill_calls`: the lanes' use is
      `generated tokens / (decode_steps * lanes)` (the first token of a completion comes from
      its prefill).

  Returns:
    The completions, prompt by prompt, sample by sample.

  Raises:
    DecodeError: an empty prompt, ids outside the vocabulary, no room, bad settings.
  """
  _positive_int(steps_per_check, "steps_per_check")
  stops = completion_lib.check_stops(stop_strings, detokenize)
  work = _make_work(prompts, vocab_size=model.cfg.vocab_size, num_samples=num_samples,
                    max_new_tokens=max_new_tokens, max_len=max_len, lanes=lanes)
  prompts, shape = work.prompts, _cache_shape(work)
  state = cache_lib.init_state(model.cfg, **shape)
  graphdef, params = nnx.split(model)
  params = jax.device_put(params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  stop_arr = jnp.asarray(list(stop_ids) or [-2], jnp.int32)
  seed_arr = jnp.int32(seed)
  max_steps = jnp.int32(steps_per_check if stops else state["tokens"].shape[1])
  while True:
    prefill, started = work.refill()
    if prefill:
      state = _prefill(graphdef, params, state, work, prefill, shape["prompt_slots"])
    if started:
      state = _start(state, work, started, stop_arr, seed_arr, sampling)
    if not work.lane_work:
      break
    until = min(len(work.waiting), max(1, work.lanes // REFILL_SHARE)) if work.waiting else 0
    state = cache_lib.steps(graphdef, params, state, stop_arr, seed_arr, max_steps,
                            jnp.int32(until), sampling=sampling)
    state = _collect(state, work, stops=stops, detokenize=detokenize, stop_ids=stop_ids)
  if stats is not None:
    stats.update(lanes=work.lanes, decode_steps=int(state["steps"]),
                 prefill_calls=work.prefill_calls)
  return [work.done[(p, s)] for p in range(len(prompts)) for s in range(num_samples)]

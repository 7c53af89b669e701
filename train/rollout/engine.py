"""The rollout engine: `n` completions of every prompt from one prefill, lanes reused as they
finish, every token with its two log-probs.

Algorithm (`generate`):
  1. The work is every `(prompt, sample)` pair, prompt by prompt. The cache
     (`train.rollout.cache`) has `lanes` lanes and as many prompt groups as it can need (a group
     holds a prompt while any lane decodes one of its completions, so `min(prompts, lanes)`).
  2. Refill: each idle lane takes the next waiting completion. A prompt that is not in a group
     yet is prefilled into a free one (one forward pass over its padded row, several prompts
     per call); its completions all read that group, however many there are.
  3. Decode steps run on the device until a lane ends while completions still wait (or, with
     stop strings, every `steps_per_check` steps), then the host takes the ended lanes'
     tokens, looks for stop strings in the lanes still running, frees the lanes and groups that
     are done, and goes back to step 2. Lanes never wait for the longest completion of a batch.
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

from train.model import decoder as model_lib
from train.rollout import cache as cache_lib
from train.rollout.sampling import DecodeError, GREEDY, Sampling

MIN_BUCKET = 16  # the shortest padded prompt row
PREFILL_ROWS = 8  # prompts per prefill call when many wait (a single one is prefilled alone)
DEFAULT_LANES = 256  # the most completions decoded at once when `lanes` is not given
FINISH_REASONS = {cache_lib.STOP_ID: "stop", cache_lib.LENGTH: "length", cache_lib.ROOM: "room"}


@dataclasses.dataclass(frozen=True)
class Completion:
  """One completion of one prompt.

  Attributes:
    prompt: the prompt's index.
    sample: the completion's index among the prompt's `num_samples`.
    token_ids: the new tokens (a stop id that ended it included).
    logprobs: each token's log-prob under the model at the sampling temperature, whole
      vocabulary (`train.rollout.sampling`).
    sampling_logprobs: each token's log-prob under the distribution it was drawn from (after
      top-k / top-p, renormalised; 0 for greedy choice).
    finish_reason: "stop" (a stop id), "stop_string", "length" (`max_new_tokens`) or "room"
      (the model's positions are full).
    text: the completion decoded (without a final stop id, cut before a stop string), when a
      `detokenize` was given; else None.
    stop: the stop id or stop string that ended it, else None.
  """

  prompt: int
  sample: int
  token_ids: tuple[int, ...]
  logprobs: tuple[float, ...]
  sampling_logprobs: tuple[float, ...]
  finish_reason: str
  text: str | None = None
  stop: int | str | None = None


def bucket_length(length: int) -> int:
  """The next power of two, at least `MIN_BUCKET`."""
  return max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length())


def _positive_int(value: object, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise DecodeError(f"{name} must be an int >= 1, got {value!r}")
  return value


def check_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int, max_new_tokens: int,
                  max_len: int | None) -> list[list[int]]:
  """The prompts as lists of ints; raises DecodeError naming the prompt and the bad value."""
  _positive_int(max_new_tokens, "max_new_tokens")
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


def room(length: int, *, max_new_tokens: int, max_len: int | None) -> tuple[int, int]:
  """`(the most new tokens of a prompt of `length` tokens, the reason it ends there)`."""
  if max_len is not None and max_len - length < max_new_tokens:
    return max_len - length, cache_lib.ROOM
  if max_new_tokens > np.iinfo(np.int32).max:
    raise DecodeError(f"max_new_tokens must be at most {np.iinfo(np.int32).max} without a "
                      f"max_len, got {max_new_tokens!r}")
  return max_new_tokens, cache_lib.LENGTH


def check_stops(stop_strings: Sequence[str], detokenize: Callable[..., str] | None) -> list[str]:
  """The stop strings, checked: non-empty strings, and a `detokenize` to find them with."""
  stops = list(stop_strings)
  for s in stops:
    if not isinstance(s, str) or not s:
      raise DecodeError(f"a stop string must be a non-empty string, got {s!r}")
  if stops and detokenize is None:
    raise DecodeError("stop strings need the tokenizer's decode (detokenize=): the run has no "
                      "tokenizer")
  return stops


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

  def refill(self) -> tuple[list[tuple[int, int]], list[int]]:
    """Step 2 on the host: `(prompts to prefill as (prompt, group), lanes given work)`."""
    prefill, started = [], []
    while self.free_lanes and self.waiting:
      p, s = self.waiting[0]
      if p not in self.group_of:
        if not self.free_groups:
          break
        self.group_of[p] = self.free_groups.pop(0)
        self.left[p] = self.num_samples
        prefill.append((p, self.group_of[p]))
      self.waiting.popleft()
      lane = self.free_lanes.pop(0)
      self.lane_work[lane], self.checked[lane] = (p, s), 0
      started.append(lane)
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


def _completion(work: _Work, lane: int, tokens: np.ndarray, logp: np.ndarray, logq: np.ndarray,
                reason: str, *, detokenize: Callable[..., str] | None, stop_ids: Sequence[int],
                stop: int | str | None = None, cut: int | None = None) -> Completion:
  p, s = work.lane_work[lane]
  ids = [int(t) for t in tokens]
  if reason == "stop":
    stop = ids[-1]
  text = None
  if detokenize is not None:
    text = detokenize(ids[:-1] if ids and ids[-1] in stop_ids else ids)
    if cut is not None:
      text = text[:cut]
  return Completion(prompt=p, sample=s, token_ids=tuple(ids),
                    logprobs=tuple(float(x) for x in logp),
                    sampling_logprobs=tuple(float(x) for x in logq),
                    finish_reason=reason, text=text, stop=stop)


def _first_stop(ids: list[int], since: int, stops: list[str],
                detokenize: Callable[..., str]) -> tuple[int, str, int] | None:
  """`(tokens kept, the stop string, where the text is cut)` for the first prefix of `ids`
  longer than `since` whose text holds a stop string, else None."""
  if not any(s in detokenize(ids) for s in stops):
    return None
  for k in range(since + 1, len(ids) + 1):
    text = detokenize(ids[:k])
    found = [(text.find(s), s) for s in stops if s in text]
    if found:
      at, s = min(found)
      return k, s, at
  return None


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
    found = (_first_stop([int(x) for x in tokens[i, :t]], work.checked[lane], stops, detokenize)
             if stops else None)
    work.checked[lane] = t
    if found is not None:
      k, stop, cut = found
      cancelled[lane] = bool(active_L[lane])
      done = _completion(work, lane, tokens[i, :k], logp[i, :k], logq[i, :k], "stop_string",
                         detokenize=detokenize, stop_ids=(), stop=stop, cut=cut)
    elif not active_L[lane]:
      done = _completion(work, lane, tokens[i, :t], logp[i, :t], logq[i, :t],
                         FINISH_REASONS[int(reason_L[lane])], detokenize=detokenize,
                         stop_ids=stop_ids)
    else:
      continue
    work.release(lane, done)
  return cache_lib.cancel(state, jnp.asarray(cancelled)) if cancelled.any() else state


def generate(model: model_lib.Decoder, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, num_samples: int = 1, sampling: Sampling = GREEDY,
             seed: int = 0, stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
             detokenize: Callable[[Sequence[int]], str] | None = None,
             max_len: int | None = None, lanes: int | None = None,
             steps_per_check: int = 8) -> list[Completion]:
  """`num_samples` completions of every prompt (see the module docstring).

  Args:
    model: the decoder (any attention backend: decoding runs the XLA math on the cache, on one
      device; parameters placed on a mesh are copied there).
    prompts: token ids of each prompt, as the model should see them (BOS included if the run's
      documents began with one).
    max_new_tokens: the most tokens of a completion (any int >= 1; the cache holds what fits).
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

  Returns:
    The completions, prompt by prompt, sample by sample.

  Raises:
    DecodeError: an empty prompt, ids outside the vocabulary, no room, bad settings.
  """
  prompts = check_prompts(prompts, vocab_size=model.cfg.vocab_size,
                          max_new_tokens=max_new_tokens, max_len=max_len)
  _positive_int(num_samples, "num_samples")
  _positive_int(steps_per_check, "steps_per_check")
  stops = check_stops(stop_strings, detokenize)
  total = len(prompts) * num_samples
  lanes = min(total, DEFAULT_LANES if lanes is None else _positive_int(lanes, "lanes"))
  rooms = [room(len(p), max_new_tokens=max_new_tokens, max_len=max_len) for p in prompts]
  work = _Work(prompts=prompts, num_samples=num_samples, lanes=lanes,
               groups=min(len(prompts), lanes), rooms=rooms)
  prompt_slots = bucket_length(max(len(p) for p in prompts))
  state = cache_lib.init_state(model.cfg, groups=work.groups, prompt_slots=prompt_slots,
                               lanes=lanes, new_slots=max(r for r, _ in rooms))
  graphdef, params = nnx.split(model)
  params = jax.device_put(params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  stop_arr = jnp.asarray(list(stop_ids) or [-2], jnp.int32)
  seed_arr = jnp.int32(seed)
  max_steps = jnp.int32(steps_per_check if stops else state["tokens"].shape[1])
  while True:
    prefill, started = work.refill()
    if prefill:
      state = _prefill(graphdef, params, state, work, prefill, prompt_slots)
    if started:
      state = _start(state, work, started, stop_arr, seed_arr, sampling)
    if not work.lane_work:
      break
    state = cache_lib.steps(graphdef, params, state, stop_arr, seed_arr, max_steps,
                            jnp.asarray(bool(work.waiting)), sampling=sampling)
    state = _collect(state, work, stops=stops, detokenize=detokenize, stop_ids=stop_ids)
  return [work.done[(p, s)] for p in range(len(prompts)) for s in range(num_samples)]

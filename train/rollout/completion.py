"""A finished completion as the engine returns it, and how stop strings end one.

A stop string ends a completion once the completion's decoded text holds it, as lm-eval's
`until` and vLLM's `stop`: the completion keeps its tokens up to the one that completed the
string (the first prefix whose text holds it), and its `text` is cut before the string. A string
split across two tokens is found when the second one arrives.

Example: tokens decoding to `"ab"`, `"c\n"`, `"de"` with the stop string `"c\nd"`: the prefix of
two tokens (`"abc\n"`) does not hold it, three (`"abc\nde"`) does, so the completion keeps the
three tokens and its text is `"ab"`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from train.rollout import cache as cache_lib
from train.rollout.sampling import DecodeError

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


def make(prompt: int, sample: int, tokens: np.ndarray, logp: np.ndarray, logq: np.ndarray,
         reason: str, *, detokenize: Callable[..., str] | None, stop_ids: Sequence[int],
         stop: int | str | None = None, cut: int | None = None) -> Completion:
  """A lane's `Completion` from its recorded arrays (`cut`: where a stop string's text ends)."""
  p, s = prompt, sample
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


def first_stop(ids: list[int], since: int, stops: list[str],
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

"""Rewards of completions: the built-in checkers, a user's own functions, several weighted.

`rl.rewards` names them, comma-separated, each `NAME` or `NAME=WEIGHT` (weight 1 by default);
a completion's reward is the weighted sum. Built in (`BUILTIN`):

- `math`: `math_verify.verify(parse(answer), parse(completion))` (1 or 0; the `rl` extra; a bare
  answer such as `2(x+1)` is read as `$2(x+1)$`);
- `gsm8k`: the number after the completion's first `#### ` equals the answer's (strict, as
  lm-eval's gsm8k `strict-match`); `gsm8k_flexible`: its last number does (`flexible-extract`);
- `exact`: the stripped completion equals the stripped answer;
- `format`: `rl.format_pattern` is found in the completion (`re.search`);
- `overlong`: DAPO's soft over-length penalty: 0 up to `max_completion_length - buffer` tokens,
  then falling linearly to -1 at `max_completion_length` (`rl.overlong_buffer` = buffer).

The answer is the prompt record's `answer` field; a GSM8K answer (a solution ending in
`#### N`) counts as `N`. A user's reward is `MODULE:FUNCTION`, called as
`function(prompt, completion, record) -> float` with the texts and the prompt's record.

A reward that raises, returns NaN, infinity or a non-number is a `RewardError` naming the
reward and the prompt's record: nothing is trained on that round.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from segpack.errors import UserError

__all__ = ["BUILTIN", "Reward", "RewardError", "Sample", "parse_rewards", "score"]

NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")
STRICT = re.compile(r"#### (-?[0-9.,]+)")  # lm-eval gsm8k's strict-match


class RewardError(UserError, ValueError):
  """A reward that cannot be named, computed or trusted."""


@dataclasses.dataclass(frozen=True)
class Sample:
  """What a reward sees of one completion.

  Attributes:
    prompt: the prompt's text.
    completion: the completion's text.
    record: the prompt's record (its fields other than the prompt).
    where: the record, for errors (`data.train record 12`).
    num_tokens: the completion's tokens.
    max_tokens: `rl.max_completion_length`.
  """

  prompt: str
  completion: str
  record: Mapping[str, Any]
  where: str
  num_tokens: int
  max_tokens: int


def _number(text: str) -> str | None:
  text = text.strip().replace(",", "").rstrip(".")
  try:
    value = float(text)
  except ValueError:
    return None
  return repr(int(value)) if value.is_integer() else repr(value)


def answer_of(record: Mapping[str, Any]) -> str:
  """The record's answer: the text after a GSM8K solution's `#### `, else the whole field."""
  answer = str(record["answer"])
  return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def _gsm8k(sample: Sample, _: Any) -> float:
  found = STRICT.search(sample.completion)
  return float(found is not None and _number(found.group(1)) == _number(answer_of(sample.record)))


def _gsm8k_flexible(sample: Sample, _: Any) -> float:
  found = NUMBER.findall(sample.completion)
  return float(bool(found) and _number(found[-1]) == _number(answer_of(sample.record)))


def _exact(sample: Sample, _: Any) -> float:
  return float(sample.completion.strip() == answer_of(sample.record))


def _format(sample: Sample, pattern: re.Pattern[str]) -> float:
  return float(pattern.search(sample.completion) is not None)


def _overlong(sample: Sample, buffer: int) -> float:
  start = sample.max_tokens - buffer
  if buffer <= 0 or sample.num_tokens <= start:
    return 0.0
  return max(-1.0, (start - sample.num_tokens) / buffer)


def _math(sample: Sample, _: Any) -> float:
  try:
    import math_verify  # optional: the `rl` extra, imported by the one reward that needs it
  except ImportError as e:
    raise RewardError("reward 'math' needs math-verify: pip install 'segpack[rl]' (or "
                      "math-verify)") from e
  answer = answer_of(sample.record)
  if "$" not in answer and "\\boxed" not in answer:
    answer = f"${answer}$"  # a bare expression, read as LaTeX math (math-verify reads "2" of "2(x+1)")
  gold = math_verify.parse(answer)
  return float(bool(math_verify.verify(gold, math_verify.parse(sample.completion))))


# name -> (function of (sample, setting), the record field it reads or None)
BUILTIN: dict[str, tuple[Callable[[Sample, Any], float], str | None]] = {
    "math": (_math, "answer"), "gsm8k": (_gsm8k, "answer"),
    "gsm8k_flexible": (_gsm8k_flexible, "answer"), "exact": (_exact, "answer"),
    "format": (_format, None), "overlong": (_overlong, None),
}


@dataclasses.dataclass(frozen=True)
class Reward:
  """One named reward: its function, weight, setting and the record field it needs."""

  name: str
  weight: float
  function: Callable[[Sample], Any]
  field: str | None = None


def _user(name: str) -> Callable[[Sample], Any]:
  module_name, _, attr = name.partition(":")
  try:
    fn = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    raise RewardError(f"rl.rewards: {name!r} is neither a built-in reward ({sorted(BUILTIN)}) "
                      f"nor an importable MODULE:FUNCTION ({type(e).__name__}: {e})") from e
  if not callable(fn):
    raise RewardError(f"rl.rewards: {name!r} is not a function")
  return lambda s: fn(s.prompt, s.completion, dict(s.record))


def parse_rewards(spec: str, *, format_pattern: str = "", overlong_buffer: int = 0
                  ) -> list[Reward]:
  """The rewards `rl.rewards` names (the module docstring), or a RewardError naming the part."""
  out = []
  for part in (p.strip() for p in str(spec).split(",")):
    name, eq, weight_text = part.partition("=")
    name = name.strip()
    try:
      weight = float(weight_text) if eq else 1.0
    except ValueError:
      weight = math.nan
    if not name or not math.isfinite(weight):
      raise RewardError(f"rl.rewards: {part!r} is not NAME or NAME=WEIGHT (a finite number), "
                        f"in rl.rewards={spec!r}")
    if name in BUILTIN:
      fn, field = BUILTIN[name]
      setting = re.compile(format_pattern) if name == "format" else overlong_buffer
      out.append(Reward(name, weight, lambda s, fn=fn, setting=setting: fn(s, setting), field))
    elif ":" in name:
      out.append(Reward(name, weight, _user(name)))
    else:
      raise RewardError(f"rl.rewards: unknown reward {name!r}; built in: {sorted(BUILTIN)}, or "
                        f"a MODULE:FUNCTION")
  return out


def check_fields(rewards: Sequence[Reward], records: Sequence[Mapping[str, Any]], *,
                 name: str) -> None:
  """Refuses prompts whose records lack a field a reward reads, naming the first."""
  for reward in rewards:
    if reward.field is None:
      continue
    for i, record in enumerate(records):
      if reward.field not in record:
        raise RewardError(f"reward {reward.name!r} reads the field {reward.field!r} of every "
                          f"prompt record; {name} record {i} has {sorted(record) or 'no field'}")


def score(rewards: Sequence[Reward], sample: Sample) -> tuple[float, list[float]]:
  """`(the weighted sum, each reward's value)` of one completion."""
  values = []
  for reward in rewards:
    try:
      value = reward.function(sample)
    except RewardError:
      raise
    except Exception as e:  # a user's function: any error is theirs to see, in one line
      raise RewardError(f"reward {reward.name!r} raised {type(e).__name__}: {e} on "
                        f"{sample.where}") from e
    if isinstance(value, bool):
      value = float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
      raise RewardError(f"reward {reward.name!r} returned {value!r} on {sample.where}: a "
                        f"finite number is needed")
    values.append(float(value))
  return sum(r.weight * v for r, v in zip(rewards, values)), values

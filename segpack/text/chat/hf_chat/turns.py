"""One sample per trained assistant turn, rendered as the model sees it when it answers.

A chat template is *prefix-stable* for a conversation when rendering more messages only appends
text. Many are not: Qwen3's writes a reasoning block into the last assistant turn only and drops
earlier turns' reasoning; Mistral v0.3's writes the system prompt into the last user turn only.
Training such a conversation whole would train turns in a form the model never sees when it
answers. `Turn` is one assistant turn `k` as the model sees it: its prompt is the template's render
of `messages[:k]` with the generation prompt, and its text is what rendering `messages[:k+1]` adds
(`turn_start` finds it). `whole_holds` tells when the whole conversation holds every turn exactly
as its own sample would: then one sample trains them all, at no extra tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from segpack.text.chat import ChatFormatError

__all__ = ["Turn", "cover", "first_difference", "turn_start", "whole_holds"]


@dataclasses.dataclass(frozen=True)
class Turn:
  """One trained assistant turn, rendered as its own sample.

  Attributes:
    index: the message index `k` of the assistant message.
    prompt: what the model is given: the render of `messages[:k]` with the generation prompt
      (for `k = 0`, or a template that cannot render it, the text before the message).
    output: what the model writes: the turn's text after `prompt`, up to the end of the render.
    from_prompt: whether `prompt` is the generation prompt (then all of `output` is the model's
      to write; else the trained text starts at the message's content).
  """

  index: int
  prompt: str
  output: str
  from_prompt: bool = True

  @property
  def text(self) -> str:
    """The sample's text: `prompt + output`."""
    return self.prompt + self.output


def _suffix_matches(prompt: str, full: str) -> list[int]:
  """`out[j]` = the length of the longest common suffix of `prompt` and `full[:j]`, for every
  `j` in `[0, len(full)]` (Z-algorithm on the reversed strings, linear time)."""
  s = prompt[::-1] + "\x00" + full[::-1]
  n, z = len(s), [0] * len(s)
  left = right = 0
  for i in range(1, n):
    if i < right:
      z[i] = min(right - i, z[i - left])
    while i + z[i] < n and s[z[i]] == s[i + z[i]]:
      z[i] += 1
    if i + z[i] > right:
      left, right = i, i + z[i]
  base = len(prompt) + 1
  # full[:j] reversed starts at s[base + len(full) - j]
  return [min(z[base + len(full) - j], len(prompt)) if j else 0 for j in range(len(full) + 1)]


def turn_start(prompt: str, full: str, *, where: str) -> int:
  """Where the turn's text begins in `full` (the render of `messages[:k+1]`), given `prompt`
  (that of `messages[:k]` with the generation prompt).

  When `full` begins with `prompt`, right after it. Else the template renders the history
  otherwise when the turn follows it (Mistral v0.3 drops the system prompt once the last message
  is no longer a user message): the turn begins after the longest common suffix of `prompt` and
  a prefix of `full`, the last such place when several tie.

  Raises:
    ChatFormatError: no common suffix at all (the turn cannot be told from the history).
  """
  if full.startswith(prompt):
    return len(prompt)
  matches = _suffix_matches(prompt, full)
  best = max(matches)
  if best == 0:
    raise ChatFormatError(f"{where}: the render of the turn shares no text with its prompt "
                          f"{_shown(prompt)}; the turn cannot be told from its history")
  return max(j for j, m in enumerate(matches) if m == best)


def whole_holds(whole: str, turns: Sequence[Turn]) -> bool:
  """Whether `whole` (the render of the whole conversation) begins with every turn's sample text,
  so that training it once trains each turn exactly as its own sample would."""
  return all(whole.startswith(turn.text) for turn in turns)


def cover(turns: Sequence[Turn]) -> list[list[Turn]]:
  """The turns grouped into samples: each group is stored as the text of its last turn, which
  begins with every other turn's text of the group, so training it trains each of them exactly as
  its own sample would.

  Algorithm (greedy from the last turn): take the last turn not yet grouped; its group is every
  ungrouped turn whose text begins it; repeat. Groups come out in turn order.

  Example (Qwen3, reasoning on every turn after one question, then a final answer): the earlier
  turns' texts all begin the final turn's text (the template keeps reasoning after the last user
  message), so the three turns are one sample, not three.
  """
  left, groups = list(turns), []
  while left:
    last = left[-1]
    group = [t for t in left if last.text.startswith(t.text)]
    groups.append(group)
    left = [t for t in left if t not in group]
  return sorted(groups, key=lambda group: group[-1].index)


def _shown(text: str, width: int = 60) -> str:
  return repr(text if len(text) <= width else "..." + text[-width:])


def first_difference(whole: str, turns: Sequence[Turn]) -> str:
  """Where the first turn that `whole` does not hold differs from it, for an error message."""
  for turn in turns:
    text = turn.text
    if whole.startswith(text):
      continue
    at = next((i for i, (a, b) in enumerate(zip(whole, text)) if a != b), min(len(whole),
                                                                             len(text)))
    lo = max(at - 30, 0)
    return (f"messages[{turn.index}] answered alone renders {text[lo:at + 30]!r} at character "
            f"{at}, the whole conversation {whole[lo:at + 30]!r}")
  return "every turn is held"

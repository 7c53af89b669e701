"""Where a chat template writes an assistant turn's reasoning (`reasoning_content`).

`ThinkTags.probe` renders one probe conversation whose assistant message carries a known
reasoning text and reads the tags the template writes around it (Qwen3's `<think>` and
`</think>`); `ThinkTags.block` finds the reasoning block in the text of one trained turn, so that
`--reasoning mask` can leave it untrained and an empty block the template inserts where the data
has none can be counted.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ThinkTags", "has_reasoning"]

_PROBE = "segpack-reasoning-probe"
# Tags looked for as text when the template's tags are not tokens of the tokenizer.
_TEXT_TAGS = ("<think>", "</think>")


def has_reasoning(message: Mapping[str, Any]) -> bool:
  """Whether an assistant message carries reasoning: a non-blank `reasoning_content` (or
  `thinking`, `reasoning`), or a `</think>` in its content (Qwen3 templates read it there)."""
  for key in ("reasoning_content", "thinking", "reasoning"):
    value = message.get(key)
    if isinstance(value, str) and value.strip():
      return True
  content = message.get("content")
  return isinstance(content, str) and _TEXT_TAGS[1] in content


@dataclasses.dataclass(frozen=True)
class ThinkTags:
  """The text a template writes before and after an assistant turn's reasoning.

  Algorithm of `probe`:
    1. Render user "Hi", then an assistant "Hello" whose `reasoning_content` is a probe text.
    2. When the probe text is not in the render, the template writes no reasoning: None.
    3. Else the tags are the special or added tokens next to the probe text, with only
       whitespace between (`<think>\\nPROBE\\n</think>`), else `<think>` and `</think>` as text
       when they are there; else None.

  Example (Qwen3): the render holds `<|im_start|>assistant\\n<think>\\nPROBE\\n</think>\\n\\nHello`,
  so the tags are `<think>` and `</think>`.
  """

  open: str
  close: str

  @classmethod
  def probe(cls, render: Callable[[list[dict[str, Any]]], str],
            markers: re.Pattern[str] | None) -> ThinkTags | None:
    """The tags of the template `render` calls (None: it writes no reasoning, or not between
    tags); `markers` matches the tokenizer's special and added tokens."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": _PROBE}]
    try:
      text = render(messages)
    except Exception:  # noqa: BLE001  # a template that refuses the probe has no tags to find
      return None
    at = text.find(_PROBE)
    if at < 0:
      return None
    before, after = text[:at], text[at + len(_PROBE):]
    found = [m for m in markers.finditer(before)] if markers is not None else []
    opening = found[-1] if found and not before[found[-1].end():].strip() else None
    closing = markers.search(after) if markers is not None else None
    if opening and closing and not after[:closing.start()].strip():
      return cls(open=opening.group(), close=closing.group())
    if before.rstrip().endswith(_TEXT_TAGS[0]) and after.lstrip().startswith(_TEXT_TAGS[1]):
      return cls(open=_TEXT_TAGS[0], close=_TEXT_TAGS[1])
    return None

  def block(self, text: str) -> tuple[int, int, bool] | None:
    """The reasoning block of one turn's `text` (what the model writes after its prompt):
    `(start, end, empty)` with `end` past the closing tag and the whitespace after it, `start`
    at the opening tag (0 when the prompt wrote it), and `empty` when only whitespace lies
    between the tags. None when the turn has no closing tag."""
    close = text.find(self.close)
    if close < 0:
      return None
    start = text.rfind(self.open, 0, close)
    inner = text[(start + len(self.open)) if start >= 0 else 0:close]
    end = close + len(self.close)
    end += len(text[end:]) - len(text[end:].lstrip())
    return max(start, 0), end, not inner.strip()

"""Where each message and each trained span lies in a conversation rendered by a chat template.

This is the template-agnostic half of `segpack.text.chat.hf_chat.template.HfChatTemplate`: it works
on the texts a template renders (prefixes of the conversation, and the prompts that ask for an
assistant turn) and on token offsets, never on the template itself. `layout` checks that the
template is *prefix-stable* (adding a message only appends text) and finds the trained character
spans; `overlap_mask` turns spans into a per-token mask (a token is trained when its characters
overlap a span, the rule transformers applies to `{% generation %}` spans); `role_counts` attributes
every trained token to the message whose rendered region holds it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from segpack.text.chat import ChatFormatError

__all__ = ["TEMPLATE_ROLE", "Layout", "layout", "locate", "overlap_mask", "region_mask",
           "role_counts"]

# The role of the text a template writes before the first message (a BOS, a default system block).
TEMPLATE_ROLE = "template"


@dataclasses.dataclass(frozen=True)
class Layout:
  """A rendered conversation and where its parts lie (character offsets into `text`).

  Attributes:
    text: the whole conversation as the template renders it.
    ends: `ends[k]` is the length of the render of `messages[:k+1]` (a prefix of `text`), so
      message `k`'s region is `[ends[k-1], ends[k])` (message 0's starts at `template_end`).
    template_end: the text before it is the template's own (before the first message).
    spans: the trained character spans `(start, end)`, in order.
    prefixes: `(name, text)` of the prefix renders whose tokens must begin the conversation's
      tokens: every `messages[:k+1]` but the whole, and every generation prompt a span was
      measured from (the model is prompted with its tokens).
  """

  text: str
  ends: tuple[int, ...]
  template_end: int
  spans: tuple[tuple[int, int], ...]
  prefixes: tuple[tuple[str, str], ...]

  def region(self, k: int) -> tuple[int, int]:
    """Message `k`'s region `[start, end)` of `text`."""
    return (self.ends[k - 1] if k else self.template_end), self.ends[k]


def _cut(text: str, width: int = 60) -> str:
  """`text` shortened for an error message (its end, where prefixes differ)."""
  return repr(text if len(text) <= width else "..." + text[-width:])


def _find_content(added: str, content: str, markers: re.Pattern[str] | None) -> int:
  """Where `content` lies in `added`, the text a message's render adds: its last occurrence that
  overlaps no marker (a special token's text: `im` is inside `<|im_end|>`), and of those the last
  that ends before the last marker when one does (the end of turn the template writes after the
  content: a newline content is not the one after it); -1 when there is none."""
  spans = [m.span() for m in markers.finditer(added)] if markers is not None else []
  found, at = [], added.find(content)
  while at >= 0:
    if not any(at < end and start < at + len(content) for start, end in spans):
      found.append(at)
    at = added.find(content, at + 1)
  before = [a for a in found if spans and a + len(content) <= spans[-1][0]]
  return (before or found or [-1])[-1]


def locate(added: str, content: str, *, from_prompt: bool, markers: re.Pattern[str] | None,
            at: str) -> tuple[int, int] | None:
  """The trained span of one assistant message within `added`, the text its render adds.

  After the generation prompt (`from_prompt`) all of `added` is the model's to write: the span
  runs from 0 through the last marker (a special or added token: the end of turn) in it, found by
  the render's structure, never by searching for the content (an answer "im" is inside
  `<|im_end|>`). Otherwise the content is found exactly, else stripped (templates trim), and the
  span runs from the content start through the last marker after it, or the content's end when
  none follows. None when nothing is left to train (no content and no marker)."""
  last = None
  if from_prompt:
    if markers is not None:
      for last in markers.finditer(added):
        pass
    end = last.end() if last is not None else len(added.rstrip())
    return (0, end) if end > 0 else None
  where, size = (_find_content(added, content, markers), len(content)) if content else (-1, 0)
  if where < 0 and content.strip():
    where, size = _find_content(added, content.strip(), markers), len(content.strip())
    if where < 0:
      raise ChatFormatError(
          f"{at}: its content {content!r:.60} is not in the text the chat template renders for "
          f"it ({added!r:.120}); the template changes contents, so the trained tokens cannot be "
          f"found")
  if where < 0:  # empty content: only what the template writes
    where, size = 0, 0
  content_end = where + size
  if markers is not None:
    for last in markers.finditer(added, content_end):
      pass
  end = last.end() if last is not None else content_end
  if size:
    start = where
  else:
    start = last.start() if last is not None else end
  return (start, end) if end > start else None


def layout(renders: Sequence[str], prompts: Mapping[int, str | None],
           messages: Sequence[Mapping[str, Any]], *, trained: Sequence[int], template_end: int,
           markers: re.Pattern[str] | None, where: str) -> Layout:
  """Checks prefix stability and finds the trained spans of a rendered conversation.

  Args:
    renders: `renders[k]` is the render of `messages[:k+1]`; the last is the whole conversation.
    prompts: for an assistant message `k > 0`, the render of `messages[:k]` with the generation
      prompt (None where it does not render).
    messages: the conversation (contents are looked up in the renders).
    trained: the indices of the assistant messages to train.
    template_end: the length of the template's own text before the first message (its render of
      no message, or the BOS it writes; 0 when unknown). Ignored when it is not a prefix.
    markers: a pattern matching any special or added token string (None: no such tokens).
    where: names the conversation in errors ("chats.jsonl:12").

  Raises:
    ChatFormatError: a prefix render that is not how the whole conversation begins, or content
      that cannot be found.
  """
  text = renders[-1]
  previous = 0
  for k, render in enumerate(renders):
    if not text.startswith(render) or len(render) < previous:
      shown = render[:previous] if len(render) < previous else render
      raise ChatFormatError(
          f"{where}: the chat template is not prefix-stable here: messages[:{k + 1}] renders as "
          f"{_cut(shown)}, which is not how the whole conversation begins (adding a message "
          f"changes earlier text), so the loss mask cannot be attributed; refused")
    previous = len(render)
  if template_end > len(renders[0]):
    template_end = 0
  spans = []
  prefixes = [(f"messages[:{k + 1}]", render) for k, render in enumerate(renders[:-1])]
  for k in trained:
    begin = len(renders[k - 1]) if k else template_end
    prompt = prompts.get(k)
    from_prompt = (prompt is not None and len(prompt) >= begin and renders[k].startswith(prompt))
    if from_prompt:
      begin = len(prompt)
      prefixes.append((f"the generation prompt of messages[{k}]", prompt))
    content = messages[k].get("content") or ""
    span = locate(renders[k][begin:], content, from_prompt=from_prompt, markers=markers,
                   at=f"{where}: messages[{k}] (role 'assistant')")
    if span is not None:
      spans.append((begin + span[0], begin + span[1]))
  return Layout(text=text, ends=tuple(len(r) for r in renders), template_end=template_end,
                spans=tuple(spans), prefixes=tuple(prefixes))


def overlap_mask(offsets: np.ndarray, *, spans: Sequence[tuple[int, int]]) -> np.ndarray:
  """uint8 `[num_tokens]`: 1 where a token's characters `[start, end)` overlap a span."""
  offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
  mask = np.zeros(len(offsets), dtype=bool)
  for start, end in spans:
    mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
  return mask.astype(np.uint8)


def region_mask(offsets: np.ndarray, *, region: tuple[int, int]) -> np.ndarray:
  """bool `[num_tokens]`: the tokens that start inside `region`."""
  starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
  return (starts >= region[0]) & (starts < region[1])


def role_counts(offsets: np.ndarray, mask: np.ndarray, *, lay: Layout,
                roles: Sequence[str]) -> dict[str, int]:
  """Trained tokens per role: a token belongs to the message whose region holds its first
  character, or to `TEMPLATE_ROLE` before the first message. Every role of the conversation is
  listed (0 when none of its tokens is trained)."""
  starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
  owner = np.minimum(np.searchsorted(np.asarray(lay.ends), starts, side="right"), len(roles) - 1)
  names = [TEMPLATE_ROLE] + list(roles)
  owner = np.where(starts < lay.template_end, 0, owner + 1)
  counts = np.bincount(owner[np.asarray(mask, dtype=bool)], minlength=len(names))
  out = dict.fromkeys(([TEMPLATE_ROLE] if lay.template_end else []) + list(roles), 0)
  for name, count in zip(names, counts.tolist()):
    if count:
      out[name] = out.get(name, 0) + int(count)
  return out

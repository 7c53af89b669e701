"""Chat data rendered with a tokenizer's own chat template (transformers' `apply_chat_template`).

`segpack tokenize --format chat --tokenizer hf:DIR` uses `HfChatTemplate` when DIR holds a chat
template (`chat_template.jinja`, `chat_template.json`, or `chat_template` in
`tokenizer_config.json`; or `--chat-template-file`); segpack's own `chat.ChatTemplate` stays the
renderer of tokenizers without one. The template is the model's, run by transformers (extra
`segpack[hf]`; never downloaded): every stored sample's tokens are exactly `apply_chat_template`'s
for the messages it stands for (with the conversation's `tools`), BOS and end-of-turn tokens
included, so the packing pipeline adds no BOS/EOS to such a dataset (manifest
`metadata.chat.add_bos_eos: false`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segpack.errors import ArgumentError
from segpack.text import chat
from segpack.text.chat import ChatFormatError, Encoded
from segpack.text.chat.hf_chat import layout as chat_layout
from segpack.text.chat.hf_chat import reasoning
from segpack.text.chat.hf_chat import turns as turns_lib
from segpack.text.chat.hf_chat.messages import validate_conversation
from segpack.text.chat.hf_chat.options import ChatOptions
from segpack.text.chat.hf_chat.render import TemplateRenderer

__all__ = ["HfChatTemplate"]

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None


class _TokenMismatch(ChatFormatError):
  """A prefix render tokenizes otherwise than the start of the text it begins."""


def _without(spans: list[tuple[int, int]], cut: tuple[int, int]) -> list[tuple[int, int]]:
  """`spans` less the characters of `cut`."""
  out = []
  for start, end in spans:
    out += [(s, e) for s, e in ((start, min(end, cut[0])), (max(start, cut[1]), end)) if e > s]
  return out


class HfChatTemplate(TemplateRenderer):
  """Renders conversations with a tokenizer's own chat template into samples (tokens, loss mask).

  Algorithm for one conversation (`render(m)` is transformers' `apply_chat_template(m,
  tools=tools, tokenize=False)`; the trained assistant messages are all of them, or the last with
  `train_on="last_assistant"`):
    1. Turns: for each trained assistant message `k`, its prompt `P_k = render(messages[:k],
       add_generation_prompt=True)` and its output, what `render(messages[:k+1])` adds
       (`turns.turn_start`; before the message when the template cannot render `P_k`).
    2. Whole or per turn (`options.turns`): "auto" keeps the conversation as one sample when its
       whole render begins with every `P_k + output_k`, in text and in tokens (then training it
       once trains each turn as the model sees it), else stores the turns' texts `P_k + output_k`,
       each training every turn whose text begins it (`turns.cover`: no turn stored twice);
       "expand" stores one sample per turn; "whole" refuses what it cannot keep
       (`ChatFormatError`).
    3. Trained characters of a turn: a template with `{% generation %}` markers: the spans it
       marks in the turn; any other: the output from its start through the last special or
       added token after the content (the end-of-turn token), so ChatML's newline after
       `<|im_end|>` is not trained. Reasoning (`options.reasoning="mask"`): the block between the
       template's think tags (`reasoning.ThinkTags`) is left out.
    4. Tokens: the tokenizer's encoding of the sample's text, which must begin with the tokens
       of each prompt (else a token would cross the boundary: refused); a token is trained when
       its characters overlap a trained span (transformers' rule for `{% generation %}`).
    5. `train_on="all"`: the whole conversation, every token trained.

  Example (Qwen3, user "Hi", assistant "Hello", user "Bye", assistant "Ok"): the whole render
  writes no think block into "Hello" but `render(messages[:2])` writes an empty one, so "auto"
  stores two samples: `...<|im_start|>assistant\\n` + `<think>\\n\\n</think>\\n\\nHello<|im_end|>\\n`
  and the same for "Ok" after the history; each trains its own output through `<|im_end|>`.
  """

  def __init__(self, directory: str | Path, *, train_on: str = "assistant",
               options: ChatOptions | None = None):
    """Loads the tokenizer of `directory` with transformers (local files only).

    Args:
      directory: a Hugging Face tokenizer directory holding a chat template.
      train_on: "assistant" (default), "last_assistant" or "all".
      options: turns, reasoning, date and template file (`ChatOptions()` when None).

    Raises:
      ValueError: no chat template, or transformers cannot load the tokenizer (naming it).
      ImportError: transformers is not installed (naming the extra).
    """
    if train_on not in chat.TRAIN_ON:
      raise ArgumentError(f"train_on must be one of {chat.TRAIN_ON}, got {train_on!r}")
    super().__init__(directory, options=options)
    self.train_on = train_on
    self._preamble = self._empty_render()

  def describe(self) -> dict[str, Any]:
    return {**super().describe(), "train_on": self.train_on}

  def _empty_render(self) -> str:
    """The template's text for no message ("" when it does not render one)."""
    try:
      return self._render([], where="preamble")
    except ChatFormatError:  # most templates read messages[0]: no text of their own
      return ""

  def _template_end(self, text: str) -> int:
    """The length of the template's own text before the first message."""
    if self._preamble and text.startswith(self._preamble):
      return len(self._preamble)
    bos = self._hf.bos_token
    return len(bos) if bos and text.startswith(bos) else 0

  def _turn(self, messages: Messages, k: int, tools: Tools, *, where: str) -> turns_lib.Turn:
    """Trained assistant message `k` as its own sample (step 1)."""
    full = self._render(messages[:k + 1], where=where, tools=tools)
    try:
      prompt = self._render(messages[:k], where=where, prompt=True, tools=tools) if k else None
    except ChatFormatError:
      prompt = None
    if prompt is not None:
      start = turns_lib.turn_start(prompt, full, where=f"{where}: messages[{k}]")
      return turns_lib.Turn(index=k, prompt=prompt, output=full[start:])
    before = self._render(messages[:k], where=where, tools=tools) if k else ""
    start = len(before) if k and full.startswith(before) else self._template_end(full)
    return turns_lib.Turn(index=k, prompt=full[:start], output=full[start:], from_prompt=False)

  def _spans(self, turn: turns_lib.Turn, messages: Messages, tools: Tools, *, at: int,
             where: str) -> tuple[list[tuple[int, int]], int]:
    """The trained spans of `turn` placed at `at` in a sample's text, and 1 when the template
    wrote an empty reasoning block into it where the message has none (step 3)."""
    message = messages[turn.index]
    base = at + len(turn.prompt)
    if self.generation_markers:
      full = self._render(messages[:turn.index + 1], where=where, tools=tools)
      shift = base - (len(full) - len(turn.output))
      spans = [(s + shift, e + shift) for s, e in
               self._generation_spans(messages[:turn.index + 1], tools=tools)
               if s + shift >= base]
    else:
      span = chat_layout.locate(turn.output, message.get("content") or "",
                                from_prompt=turn.from_prompt, markers=self._markers,
                                at=f"{where}: messages[{turn.index}] (role 'assistant')")
      spans = [] if span is None else [(base + span[0], base + span[1])]
    block = self.tags.block(turn.output) if self.tags is not None else None
    if block is None:
      return spans, 0
    if self.options.reasoning == "mask":
      spans = _without(spans, (base + block[0], base + block[1]))
    return spans, int(block[2] and not reasoning.has_reasoning(message))

  def _tokens(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    enc = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
    return np.asarray(enc["input_ids"], np.int64), np.asarray(enc["offset_mapping"]).reshape(-1, 2)

  def _check_prefixes(self, ids: np.ndarray, prefixes: Sequence[tuple[str, str]], *,
                      where: str) -> None:
    """Refuses a sample whose prefix renders tokenize otherwise than its start (a token would
    cross the boundary, or the model would be prompted with other tokens than it was trained
    after)."""
    prefixes = [(name, text) for name, text in prefixes if text]
    if not prefixes:
      return
    full = ids.tolist()
    got_all = self._hf([t for _, t in prefixes], add_special_tokens=False)["input_ids"]
    for (name, text), got in zip(prefixes, got_all):
      if full[:len(got)] != list(got):
        raise _TokenMismatch(
            f"{where}: the chat template is not prefix-stable in tokens: {name} (ending "
            f"{text[-30:]!r}) ends with the tokens {list(got)[-3:]}, the sample has "
            f"{full[max(len(got) - 3, 0):len(got)]} there (a token merges across the boundary, "
            f"e.g. a content that begins with whitespace); refused")

  def _sample(self, text: str, turns: Sequence[turns_lib.Turn], messages: Messages,
              tools: Tools, *, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    """One stored sample: its text's tokens, the mask of `turns`' outputs, the count of empty
    reasoning blocks (steps 3 and 4)."""
    ids, offsets = self._tokens(text)
    # The prompts' tokens must begin the sample's: the model is prompted with them (a template
    # with `{% generation %}` markers defines the mask itself, as transformers reads it).
    prefixes = [] if self.generation_markers else [
        (f"the generation prompt of messages[{t.index}]", t.prompt) for t in turns]
    if len(turns) > 1 or (turns and turns[0].text != text):
      prefixes += [(f"messages[:{t.index + 1}]", t.text) for t in turns if t.text != text]
    self._check_prefixes(ids, prefixes, where=where)
    spans, empty = [], 0
    for turn in turns:
      found, e = self._spans(turn, messages, tools, at=0, where=where)
      spans += found
      empty += e
    mask = chat_layout.overlap_mask(offsets, spans=spans)
    if not mask.any():
      raise ChatFormatError(f"{where}: no token is trained with train_on={self.train_on!r} (the "
                            f"template writes nothing of the assistant messages to train)")
    return ids, mask, empty

  def _whole(self, whole: str, turns: Sequence[turns_lib.Turn], messages: Messages,
             tools: Tools, *, where: str) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The conversation as one sample, or None when that would not train each turn as its own
    sample would ("whole" refuses instead)."""
    refuse = self.options.turns == "whole"
    if not turns_lib.whole_holds(whole, turns):
      if refuse:
        raise ChatFormatError(
            f"{where}: the chat template is not prefix-stable here: "
            f"{turns_lib.first_difference(whole, turns)}; pass turns='auto' or 'expand' "
            f"(--turns) to store one sample per assistant turn")
      return None
    try:
      return self._sample(whole, turns, messages, tools, where=where)
    except _TokenMismatch:
      if refuse:
        raise
      return None

  def _per_turn(self, turns: Sequence[turns_lib.Turn], messages: Messages, tools: Tools, *,
                where: str) -> list[tuple[np.ndarray, np.ndarray, int, tuple[int, ...]]]:
    """The samples of an expanded conversation: with `turns="auto"`, each sample trains every
    turn its text holds exactly (`turns.cover`), so no turn is stored twice; with "expand", one
    sample per turn."""
    def one(group):
      return (*self._sample(group[-1].text, group, messages, tools, where=where),
              tuple(t.index for t in group))

    if self.options.turns == "expand":
      return [one([t]) for t in turns]
    out = []
    for group in turns_lib.cover(turns):
      try:
        out.append(one(group))
      except _TokenMismatch:
        if len(group) == 1:
          raise
        out += [one([t]) for t in group]
    return out

  def encode_conversation(self, conversation: Any, *, where: str = "conversation") -> Encoded:
    """Validates and encodes one conversation (its messages, or a `chat.Conversation` with
    tools) into its samples.

    Raises:
      ChatFormatError: naming `where`: invalid messages or tools, a template error, a turn that
        cannot be found or kept, or no trained token.
    """
    messages, tools = validate_conversation(conversation, where=where, train_on=self.train_on,
                                            control=self._control)
    roles = dict.fromkeys(m["role"] for m in messages)
    if self.train_on == "all":
      ids, mask, counts = self._encode_all(messages, tools, where=where)
      return Encoded(samples=[(ids, mask)], trained_by_role=counts, whole_tokens=int(ids.size))
    whole = self._render(messages, where=where, tools=tools)
    assistants = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    trained = assistants[-1:] if self.train_on == "last_assistant" else assistants
    turns = [self._turn(messages, k, tools, where=where) for k in trained]
    kept = None if self.options.turns == "expand" else self._whole(whole, turns, messages, tools,
                                                                   where=where)
    if kept is not None:
      samples, empty, whole_tokens = [kept[:2]], kept[2], int(kept[0].size)
      covered = [tuple(trained)]
    else:
      made = self._per_turn(turns, messages, tools, where=where)
      samples, empty = [m[:2] for m in made], sum(m[2] for m in made)
      covered = [m[3] for m in made]
      whole_tokens = int(self._tokens(whole)[0].size)
    counts = {role: 0 for role in roles}
    counts["assistant"] = int(sum(int(mask.sum()) for _, mask in samples))
    return Encoded(samples=samples, trained_by_role=counts, whole_tokens=whole_tokens,
                   expanded=kept is None, empty_think_turns=empty, sample_turns=covered)

  def _encode_all(self, messages: Messages, tools: Tools, *,
                  where: str) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """`train_on="all"`: the whole conversation, every token trained, counted per role (which
    needs a prefix-stable render)."""
    renders = [self._render(messages[:k + 1], where=where, tools=tools)
               for k in range(len(messages))]
    lay = chat_layout.layout(renders, {}, messages, trained=[],
                             template_end=self._template_end(renders[-1]),
                             markers=self._markers, where=where)
    ids, offsets = self._tokens(lay.text)
    self._check_prefixes(ids, lay.prefixes, where=where)
    mask = np.ones(ids.size, np.uint8)
    counts = chat_layout.role_counts(offsets, mask, lay=lay, roles=[m["role"] for m in messages])
    return ids, mask, counts

  def encode(self, messages: Sequence[Mapping[str, Any]], *,
             where: str = "conversation") -> tuple[np.ndarray, np.ndarray]:
    """Validates and encodes one conversation kept whole: (int64 token ids, uint8 loss mask)."""
    ids, mask, _ = self.encode_counted(messages, where=where)
    return ids, mask

  def encode_counted(self, messages: Any, *, where: str = "conversation",
                     ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """`encode`, plus the trained tokens per role.

    Raises:
      ChatFormatError: as `encode_conversation`, or a conversation stored as several samples
        (one per turn; `encode_conversation` gives them).
    """
    encoded = self.encode_conversation(messages, where=where)
    if len(encoded.samples) != 1:
      raise ChatFormatError(f"{where}: the conversation is stored as {len(encoded.samples)} "
                            f"samples, one per assistant turn (encode_conversation gives them)")
    ids, mask = encoded.samples[0]
    return ids, mask.astype(np.uint8), encoded.trained_by_role

  def __repr__(self) -> str:
    return f"HfChatTemplate({str(self.directory)!r}, train_on={self.train_on!r})"

"""Chat fine-tuning data: conversations to tokens plus a per-token loss mask.

A conversation is a JSON object `{"messages": [{"role": ..., "content": ...}, ...]}` (one per line
of a JSONL file). `ChatEncoder` renders it through a `ChatTemplate` into token ids and a mask of
the same length (1 = the token is trained as a prediction target). The mask is stored beside the
tokens in the shards (`segpack.shards.ShardWriter(loss_mask=True)`, docs/format.md) and the
packing pipeline turns mask 0 into label -100 (docs/packing.md, "Loss masks"). Conversations in a
tokenizer's own chat template are `segpack.text.chat.hf_chat`'s; files of conversations are read and
written by `segpack.text.chat.files`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from segpack.errors import ArgumentError, UserError

__all__ = ["ChatEncoder", "ChatFormatError", "ChatTemplate", "Conversation", "DEFAULT_TEMPLATE",
           "Encoded", "ROLES", "Skipped", "TRAIN_ON", "validate_messages"]

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "last_assistant", "all")


class ChatFormatError(UserError, ValueError):
  """A conversation is malformed; the message names the file:line (or index), message and field."""


def check_text(record: Any, raw: bytes, *, where: str) -> None:
  """Refuses a decoded JSON record holding an unpaired surrogate (only a `\\u` escape gives
  one; no tokenizer can encode it), naming `where` and the characters around it."""
  if b"\\u" not in raw:
    return
  text = json.dumps(record, ensure_ascii=False)
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ChatFormatError(f"{where}: holds an unpaired surrogate (an unmatched \\u escape) "
                          f"near {text[max(0, e.start - 20):e.start]!r}") from None


@dataclasses.dataclass
class Skipped:
  """Conversations skipped under `--skip-bad-lines`: how many, and the first error (for the log).

  `read_conversations` and `write_chat_dataset` add every `ChatFormatError` to it instead of
  raising when they are given one.
  """

  count: int = 0
  first: str | None = None

  def add(self, error: ChatFormatError) -> None:
    self.count += 1
    if self.first is None:
      self.first = str(error)


@dataclasses.dataclass(frozen=True)
class Conversation:
  """A conversation read with the tools offered to the model in it (a record's `tools` field).

  `read_conversations` yields one for a record that has `tools`, and the plain messages for one
  that has not; encoders take either.

  Attributes:
    messages: the value of the record's messages field (validated by the encoder).
    tools: the value of its `tools` field: a list of JSON schemas (validated by the encoder).
  """

  messages: Any
  tools: Any = None


@dataclasses.dataclass(frozen=True)
class Encoded:
  """One conversation encoded: the samples stored for it and what they cost.

  Attributes:
    samples: `(int64 token ids, uint8 loss mask)` of each stored sample: one for a conversation
      kept whole, one per trained assistant turn for one expanded per turn.
    trained_by_role: trained tokens per role, over the samples.
    whole_tokens: the tokens of the whole conversation rendered once.
    expanded: whether the conversation was expanded into one sample per trained turn.
    empty_think_turns: trained turns into which the template wrote an empty reasoning block
      where the message has no reasoning.
    sample_turns: the message indices of the assistant turns each sample trains (empty where
      not tracked: segpack's template, `train_on="all"`).
  """

  samples: list[tuple[np.ndarray, np.ndarray]]
  trained_by_role: dict[str, int]
  whole_tokens: int
  expanded: bool = False
  empty_think_turns: int = 0
  sample_turns: list[tuple[int, ...]] = dataclasses.field(default_factory=list)

  @property
  def stored_tokens(self) -> int:
    return sum(int(ids.size) for ids, _ in self.samples)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """How a conversation is rendered into text pieces (each rendered and encoded on its own).

  Algorithm (message `m` with role `r` and content `c`, of a conversation of `n` messages):
    1. The role marker of `r` (`system`, `user` or `assistant` below), then `after_marker`.
    2. The content `c`.
    3. `end_of_turn`, then `after_turn` unless `m` is the last message (so that a conversation
       ending with an assistant turn ends with its `end_of_turn`, and the EOS the pipeline adds
       after it is trained).
  Markers that are user-defined symbols of the tokenizer are one token each; otherwise they are
  encoded as text. Content may not contain a marker (it would read as a turn boundary).

  Example with the defaults, messages user "Hi" and assistant "Hello": the text pieces are
  `<|user|>`, `\\n`, `Hi`, `<|end|>`, `\\n`, `<|assistant|>`, `\\n`, `Hello`, `<|end|>`, and with
  `train_on="assistant"` only `Hello` and its `<|end|>` are trained.

  Attributes:
    system: marker opening a system message.
    user: marker opening a user message.
    assistant: marker opening an assistant message.
    end_of_turn: marker closing every message.
    after_marker: text between a role marker and the content.
    after_turn: text between `end_of_turn` and the next message's marker.
  """

  system: str = "<|system|>"
  user: str = "<|user|>"
  assistant: str = "<|assistant|>"
  end_of_turn: str = "<|end|>"
  after_marker: str = "\n"
  after_turn: str = "\n"

  def __post_init__(self):
    markers = self.markers
    if any(not isinstance(m, str) or not m for m in markers) or len(set(markers)) != 4:
      raise ArgumentError(f"ChatTemplate: system, user, assistant and end_of_turn must be distinct "
                       f"non-empty strings, got {markers!r}")
    for name in ("after_marker", "after_turn"):
      if not isinstance(getattr(self, name), str):
        raise ArgumentError(f"ChatTemplate: {name} must be a str, got {getattr(self, name)!r}")

  @property
  def markers(self) -> tuple[str, str, str, str]:
    """The four markers (system, user, assistant, end_of_turn): the tokenizer's special symbols."""
    return (self.system, self.user, self.assistant, self.end_of_turn)

  def marker(self, role: str) -> str:
    return {"system": self.system, "user": self.user, "assistant": self.assistant}[role]

  def render(self, messages: Sequence[Mapping[str, str]]) -> str:
    """The whole conversation as one string (for reading; encoding goes piece by piece)."""
    parts = []
    for k, message in enumerate(messages):
      parts += [self.marker(message["role"]), self.after_marker, message["content"],
                self.end_of_turn]
      if k + 1 < len(messages):
        parts.append(self.after_turn)
    return "".join(parts)


DEFAULT_TEMPLATE = ChatTemplate()


def _check_train_on(train_on: str) -> None:
  if train_on not in TRAIN_ON:
    raise ArgumentError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")


def validate_messages(messages: Any, *, where: str, template: ChatTemplate = DEFAULT_TEMPLATE,
                      train_on: str = "assistant") -> list[dict[str, str]]:
  """Checks one conversation's messages; returns them as plain dicts of role and content.

  Rules: a non-empty list of objects, each with a `role` in `ROLES` and a string `content` (other
  keys are refused, so that e.g. tool calls are not silently dropped); `system` only as the first
  message; no template marker inside a content; at least one assistant message unless
  `train_on="all"` (else nothing would be trained).

  Args:
    messages: the value of the conversation's `messages` field.
    where: names the conversation in errors, e.g. "chats.jsonl:12".
    template: its markers may not occur in contents.
    train_on: "assistant", "last_assistant" or "all".

  Raises:
    ChatFormatError: naming `where`, the message index, role and field.
  """
  _check_train_on(train_on)
  if not isinstance(messages, list) or not messages:
    raise ChatFormatError(f"{where}: messages must be a non-empty list, got {messages!r:.80}")
  out = []
  for k, message in enumerate(messages):
    at = f"{where}: messages[{k}]"
    if not isinstance(message, dict):
      raise ChatFormatError(f"{at} must be an object with role and content, got {message!r:.80}")
    extra = sorted(set(message) - {"role", "content"})
    if extra:
      raise ChatFormatError(f"{at}: unsupported field(s) {extra} (only role and content)")
    role = message.get("role")
    if role not in ROLES:
      raise ChatFormatError(f"{at}: role must be one of {ROLES}, got {role!r:.80}")
    if role == "system" and k:
      raise ChatFormatError(f"{at}: role 'system' is only allowed as the first message")
    content = message.get("content")
    if not isinstance(content, str):
      raise ChatFormatError(f"{at} (role {role!r}): content must be a string, got "
                            f"{type(content).__name__}: {content!r:.80}")
    for marker in template.markers:
      if marker in content:
        raise ChatFormatError(f"{at} (role {role!r}): content contains the template marker "
                              f"{marker!r}")
    out.append({"role": role, "content": content})
  if train_on != "all" and not any(m["role"] == "assistant" for m in out):
    raise ChatFormatError(f"{where}: no assistant message, so nothing would be trained with "
                          f"train_on={train_on!r}")
  return out


class ChatEncoder:
  """Encodes conversations into (tokens, loss mask) with a tokenizer and a `ChatTemplate`.

  Algorithm:
    1. Markers: each marker that is a user-defined symbol of the tokenizer (`symbol_id`) becomes
       that one id; any other marker is encoded as text (`strict_markers=True` refuses that).
    2. Every piece of `ChatTemplate.render` (marker, `after_marker`, content, `end_of_turn`,
       `after_turn`) is encoded on its own and the ids are concatenated, so each token belongs to
       exactly one piece and the mask follows piece boundaries exactly.
    3. Mask: with `train_on="all"` every token is 1; otherwise the content and the `end_of_turn`
       of the trained assistant messages (all of them, or only the last with
       `"last_assistant"`) are 1 and everything else (markers, separators, system and user
       messages) 0.

  Example (markers are symbols, "Hello" one token h): user "Hi" then assistant "Hello" gives
  ids [U, nl, hi, E, nl, A, nl, h, E] and mask [0, 0, 0, 0, 0, 0, 0, 1, 1]; the pipeline's EOS
  after the final E is trained too (its mask is the last token's).
  """

  def __init__(self, tokenizer: Any, *, template: ChatTemplate = DEFAULT_TEMPLATE,
               train_on: str = "assistant", strict_markers: bool = False):
    """Creates the encoder.

    Args:
      tokenizer: has `encode(text) -> 1-D int array` and optionally `symbol_id(piece)` (a
        `segpack.text.tokenizers.spm.SpmTokenizer`).
      template: the chat template.
      train_on: "assistant" (default), "last_assistant" or "all".
      strict_markers: raise when a marker is not a single special symbol of the tokenizer.
    """
    _check_train_on(train_on)
    self.tokenizer = tokenizer
    self.template = template
    self.train_on = train_on
    self._ids: dict[str, np.ndarray] = {}
    symbol_id = getattr(tokenizer, "symbol_id", None)
    self.markers_are_symbols = True
    for marker in template.markers:
      i = symbol_id(marker) if symbol_id is not None else None
      if i is None:
        self.markers_are_symbols = False
        if strict_markers:
          raise ArgumentError(f"ChatEncoder: marker {marker!r} is not a special symbol of "
                           f"{tokenizer!r}; train the model with user_defined_symbols="
                           f"{list(template.markers)!r} or pass strict_markers=False")
        ids = np.asarray(tokenizer.encode(marker), dtype=np.int64)
      else:
        ids = np.asarray([i], dtype=np.int64)
      self._ids[marker] = ids

  def _text(self, text: str) -> np.ndarray:
    if not text:
      return np.zeros(0, dtype=np.int64)
    return np.asarray(self.tokenizer.encode(text), dtype=np.int64)

  def describe(self) -> dict[str, Any]:
    """The manifest's `metadata.chat` for data rendered by this encoder (`"renderer": "segpack"`;
    a manifest written before that key existed has none, read the same way)."""
    return {"renderer": "segpack", "template": dataclasses.asdict(self.template),
            "train_on": self.train_on, "markers_are_symbols": self.markers_are_symbols}

  def encode(self, messages: Sequence[Mapping[str, str]], *,
             where: str = "conversation") -> tuple[np.ndarray, np.ndarray]:
    """Validates and encodes one conversation.

    Args:
      messages: the conversation's messages.
      where: names the conversation in errors.

    Returns:
      (int64 token ids, uint8 loss mask), both 1-D of the same length.
    """
    ids, mask, _ = self.encode_counted(messages, where=where)
    return ids, mask

  def encode_counted(self, messages: Sequence[Mapping[str, str]], *, where: str = "conversation",
                     ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """`encode`, plus the trained tokens per role (every role of the conversation listed; a
    message's marker, content, end marker and separator count as its role's)."""
    messages = validate_messages(messages, where=where, template=self.template,
                                 train_on=self.train_on)
    t = self.template
    assistants = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    trained = set(assistants[-1:] if self.train_on == "last_assistant" else assistants)
    every = 1 if self.train_on == "all" else 0
    ids, mask = [], []
    counts = dict.fromkeys((m["role"] for m in messages), 0)
    for k, message in enumerate(messages):
      on = 1 if every or k in trained else 0
      head = np.concatenate([self._ids[t.marker(message["role"])], self._text(t.after_marker)])
      body = np.concatenate([self._text(message["content"]), self._ids[t.end_of_turn]])
      tail = self._text(t.after_turn) if k + 1 < len(messages) else np.zeros(0, np.int64)
      ids += [head, body, tail]
      mask += [np.full(head.size, every, np.uint8), np.full(body.size, on, np.uint8),
               np.full(tail.size, every, np.uint8)]
      counts[message["role"]] += every * (head.size + tail.size) + on * body.size
    return np.concatenate(ids), np.concatenate(mask), counts

  def encode_conversation(self, conversation: Any, *, where: str = "conversation") -> Encoded:
    """One conversation (its messages, or a `Conversation`) as one sample (`encode_counted`).

    Raises:
      ChatFormatError: as `encode_counted`, or a conversation with tools (segpack's template
        has no place for their schemas).
    """
    if isinstance(conversation, Conversation):
      if conversation.tools is not None:
        raise ChatFormatError(f"{where}: the conversation has tools, which segpack's chat template "
                              f"cannot render; use a tokenizer with its own chat template "
                              f"(tokenizer='hf:DIR' (--tokenizer))")
      conversation = conversation.messages
    ids, mask, counts = self.encode_counted(conversation, where=where)
    return Encoded(samples=[(ids, mask)], trained_by_role=counts, whole_tokens=int(ids.size))

  def prompt_ids(self, messages: Sequence[Mapping[str, str]], *,
                 where: str = "prompt") -> list[int]:
    """The ids of `messages` followed by the assistant marker and `after_marker` (what the model
    continues with an answer), encoded as `encode` encodes them.

    No BOS: the packing pipeline put the BOS before every document of segpack-template data, so
    the caller puts the tokenizer's BOS first, as the run did (`data.add_bos`).
    """
    messages = validate_messages(messages, where=where, template=self.template, train_on="all")
    t = self.template
    parts = []
    for message in messages:
      parts += [self._ids[t.marker(message["role"])], self._text(t.after_marker),
                self._text(message["content"]), self._ids[t.end_of_turn],
                self._text(t.after_turn)]
    parts += [self._ids[t.assistant], self._text(t.after_marker)]
    return [int(i) for i in np.concatenate(parts)]

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The end-of-turn marker's id when it is one token, and the tokenizer's EOS id."""
    end = self._ids[self.template.end_of_turn]
    eos = getattr(self.tokenizer, "eos_id", None)
    out = ([int(end[0])] if end.size == 1 else []) + (
        [int(eos)] if eos is not None and eos >= 0 else [])
    return tuple(dict.fromkeys(out))

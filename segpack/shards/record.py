"""A shard dataset's record: the manifest's `metadata`, read and written in one place.

`segpack tokenize` records in the manifest's `metadata` which tokenizer encoded the documents
(`metadata.tokenizer`: the tokenizer's `describe()`) and, for chat data, which chat template
rendered them and how (`metadata.chat`: the renderer's `describe()` and the counts). Every reader
takes them from `DatasetRecord.from_manifest`, and every writer stores its metadata through
`stored_metadata` (`DatasetRecord.to_metadata`):

- A known field of the wrong type is refused in one line naming the manifest and the key
  (`ShardFormatError`); `null` reads as absent.
- Keys the record does not know (the input files, `spm_model`, `runner`, ... and fields written
  by a newer segpack) are kept in `extra`, and every key keeps its place: a record written back
  gives the metadata it was read from, byte for byte once serialised (`metadata_sha256` and the
  Beam and local manifests depend on it).

Example:

    record = DatasetRecord.from_manifest(manifest, where="data/manifest.json")
    record.tokenizer.model_file     # "spm.model"
    record.special_id("bos_id")     # 2: the BOS id the packing pipeline adds
    record.chat is None             # True: plain text, no chat template
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping
from typing import Any, ClassVar

from segpack.errors import ArgumentError
from segpack.shards.format import ShardFormatError

__all__ = ["ChatRecord", "DatasetRecord", "SPECIAL_IDS", "TokenizerRecord", "stored_metadata"]

# The special ids a record gives (`DatasetRecord.special_id`).
SPECIAL_IDS = ("bos_id", "eos_id", "pad_id")
_EMPTY: Mapping[str, Any] = types.MappingProxyType({})


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_object_of(value: Any, test: Any) -> bool:
  return isinstance(value, Mapping) and all(
      isinstance(k, str) and test(v) for k, v in value.items())


# A field's kind -> (its test, how an error names it).
_KINDS = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an int"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "strings": (lambda v: _is_object_of(v, lambda x: isinstance(x, str)),
                "an object of strings"),
    "counts": (lambda v: _is_object_of(v, _is_int), "an object of ints"),
}


def _freeze(value: Any) -> Any:
  """A JSON value made read-only: objects as read-only mappings, lists as tuples."""
  if isinstance(value, Mapping):
    return types.MappingProxyType({k: _freeze(v) for k, v in value.items()})
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


def _thaw(value: Any) -> Any:
  """`_freeze` undone: plain dicts and lists (JSON-ready)."""
  if isinstance(value, _Record):
    return value.to_dict()
  if isinstance(value, Mapping):
    return {k: _thaw(v) for k, v in value.items()}
  if isinstance(value, tuple):
    return [_thaw(v) for v in value]
  return value


def _rebuild(cls: type[_Record], data: dict[str, Any]) -> _Record:
  """A pickled record read back (`_Record.__reduce__`)."""
  return cls.parse(data, key=cls.KEY, where="a pickled dataset record")


class _Record:
  """What the three records share: parsing a JSON object by the kinds of `FIELDS`, the unknown
  keys kept in `extra`, every key written back in its place (`order`)."""

  KEY: ClassVar[str]
  FIELDS: ClassVar[dict[str, str]]  # field -> kind (`_KINDS`)
  extra: Mapping[str, Any]
  order: tuple[str, ...]

  @classmethod
  def _field(cls, name: str, value: Any, *, key: str, where: str) -> Any:
    test, kind = _KINDS[cls.FIELDS[name]]
    if value is not None and not test(value):
      raise ShardFormatError(f"{where}: {key}.{name} must be {kind} or null, got {value!r:.80}")
    return _freeze(value)

  @classmethod
  def parse(cls, value: Any, *, key: str, where: str | os.PathLike[str]) -> Any:
    """The record of the JSON object `value`, found at `key` of the manifest `where`.

    Raises:
      ShardFormatError: `value` is not an object, or a field has the wrong type (one line
        naming `where` and the key).
    """
    where = os.fspath(where)
    if not isinstance(value, Mapping):
      raise ShardFormatError(f"{where}: {key} must be an object, got {value!r:.80}")
    fields, extra = {}, {}
    for name, item in value.items():
      if name in cls.FIELDS:
        fields[name] = cls._field(name, item, key=key, where=where)
      else:
        extra[name] = _freeze(item)
    return cls(**fields, extra=types.MappingProxyType(extra), order=tuple(value))

  def to_dict(self) -> dict[str, Any]:
    """The JSON object of the record: its keys in the order read (fields set since, then new
    extra keys, after them), `null` where a key was read as `null`."""
    out = {}
    for name in self.order:
      if name in self.FIELDS:
        out[name] = _thaw(getattr(self, name))
      elif name in self.extra:
        out[name] = _thaw(self.extra[name])
    for name in self.FIELDS:
      if name not in out and getattr(self, name) is not None:
        out[name] = _thaw(getattr(self, name))
    for name, item in self.extra.items():
      out.setdefault(name, _thaw(item))
    return out

  def __reduce__(self) -> tuple[Any, ...]:  # read-only mappings do not pickle; their JSON does
    return _rebuild, (type(self), self.to_dict())


def _keep() -> Any:
  """The `order` field: the keys as read (not compared, not shown)."""
  return dataclasses.field(default=(), compare=False, repr=False)


def _none() -> Any:
  """The `extra` field's default: no key."""
  return dataclasses.field(default_factory=lambda: _EMPTY)


@dataclasses.dataclass(frozen=True)
class TokenizerRecord(_Record):
  """`metadata.tokenizer`: the tokenizer's `describe()` (`segpack.text.tokenizers.spm`,
  `segpack.text.tokenizers.hf`).

  Attributes:
    type: "sentencepiece" or "hf".
    model_file: the tokenizer file's name, a copy of which the dataset directory keeps.
    config_file: `"hf"` only: the `tokenizer_config.json` read beside it (None: none was).
    fingerprint: the tokenizer's fingerprint (SHA-256 of its files).
    vocab_size, pad_id, unk_id, bos_id, eos_id: as the tokenizer gives them (an id may be
      negative or None where the tokenizer has none).
    extra: keys the record does not know, as read.
  """

  KEY: ClassVar[str] = "metadata.tokenizer"
  FIELDS: ClassVar[dict[str, str]] = {
      "type": "str", "model_file": "str", "config_file": "str", "fingerprint": "str",
      "vocab_size": "int", "pad_id": "int", "unk_id": "int", "bos_id": "int", "eos_id": "int"}

  type: str | None = None
  model_file: str | None = None
  config_file: str | None = None
  fingerprint: str | None = None
  vocab_size: int | None = None
  pad_id: int | None = None
  unk_id: int | None = None
  bos_id: int | None = None
  eos_id: int | None = None
  extra: Mapping[str, Any] = _none()
  order: tuple[str, ...] = _keep()


@dataclasses.dataclass(frozen=True)
class ChatRecord(_Record):
  """`metadata.chat`: the renderer's `describe()` (`segpack.text.chat.ChatEncoder`,
  `segpack.text.chat.hf_chat.HfChatTemplate`) and the counts of `write_chat_dataset`.

  Attributes:
    renderer: "segpack" (segpack's template; None in manifests written before the key, read the
      same) or "hf" (the tokenizer's own template, run by transformers).
    train_on: "assistant", "last_assistant" or "all".
    template: segpack's: the `ChatTemplate` fields.
    markers_are_symbols: segpack's: whether its markers are single tokens of the tokenizer.
    template_file, template_sha256, template_text_sha256: "hf": the file the template was read
      from, its SHA-256 and that of the template text.
    generation_markers: "hf": whether the template marks what to train (`{% generation %}`).
    add_bos_eos: "hf": false: the template writes BOS and end of turn, packing adds neither.
    files: "hf": `{name: "sha256:<hex>"}` of the tokenizer and template copies in the dataset.
    turns, reasoning, date: "hf": the rendering choices (`segpack.text.chat.hf_chat.ChatOptions`:
      whole conversations or one sample per assistant turn, reasoning trained or masked, the
      date the template read).
    trained_tokens_by_role: `{role: trained tokens}` of the whole dataset.
    skipped_conversations: conversations skipped as bad (`--skip-bad-lines`).
    conversations, samples, expanded_conversations: conversations stored, the samples they gave,
      and how many were expanded into one sample per assistant turn.
    stored_tokens, whole_tokens: the tokens stored, and those of the conversations rendered
      whole once (their ratio is the cost of expansion).
    empty_think_turns: trained turns into which the template wrote an empty reasoning block.
    extra: keys the record does not know, as read.
  """

  KEY: ClassVar[str] = "metadata.chat"
  FIELDS: ClassVar[dict[str, str]] = {
      "renderer": "str", "train_on": "str", "template": "strings", "markers_are_symbols": "bool",
      "template_file": "str", "template_sha256": "str", "template_text_sha256": "str",
      "generation_markers": "bool", "add_bos_eos": "bool", "files": "strings",
      "turns": "str", "reasoning": "str", "date": "str",
      "trained_tokens_by_role": "counts", "skipped_conversations": "int", "conversations": "int",
      "samples": "int", "expanded_conversations": "int", "stored_tokens": "int",
      "whole_tokens": "int", "empty_think_turns": "int"}

  renderer: str | None = None
  train_on: str | None = None
  template: Mapping[str, str] | None = None
  markers_are_symbols: bool | None = None
  template_file: str | None = None
  template_sha256: str | None = None
  template_text_sha256: str | None = None
  generation_markers: bool | None = None
  add_bos_eos: bool | None = None
  files: Mapping[str, str] | None = None
  turns: str | None = None
  reasoning: str | None = None
  date: str | None = None
  trained_tokens_by_role: Mapping[str, int] | None = None
  skipped_conversations: int | None = None
  conversations: int | None = None
  samples: int | None = None
  expanded_conversations: int | None = None
  stored_tokens: int | None = None
  whole_tokens: int | None = None
  empty_think_turns: int | None = None
  extra: Mapping[str, Any] = _none()
  order: tuple[str, ...] = _keep()

  @property
  def expansion_overhead(self) -> float | None:
    """Stored tokens over the tokens of the conversations rendered whole (1.0: no expansion)."""
    if not self.stored_tokens or not self.whole_tokens:
      return None
    return self.stored_tokens / self.whole_tokens

  @property
  def own_template(self) -> bool:
    """Whether the data was rendered with the tokenizer's own template (`renderer == "hf"`)."""
    return self.renderer == "hf"

  @property
  def adds_bos_eos(self) -> bool:
    """Whether packing adds BOS and EOS to the documents (all but `add_bos_eos: false`)."""
    return self.add_bos_eos is not False

  @property
  def rendering(self) -> tuple[Any, ...]:
    """What decides the tokens a conversation renders to, comparable between datasets: the
    tokenizer's own template by its text's hash, segpack's by its fields (`train_on` and the
    counts decide only the loss mask, and are left out)."""
    if self.own_template:
      return ("hf", self.template_text_sha256 or self.template_sha256, self.date)
    return ("segpack", tuple(sorted((self.template or {}).items())))


@dataclasses.dataclass(frozen=True)
class DatasetRecord(_Record):
  """A dataset's `metadata`: its tokenizer, its chat rendering, the rest kept as read.

  Attributes:
    tokenizer: `metadata.tokenizer` (None: the writer recorded no tokenizer).
    chat: `metadata.chat` (None: plain text).
    bos_id, eos_id, pad_id: ids given at the top of the metadata (`ShardWriter(metadata=
      {"bos_id": 1, ...})`, as the packing benchmark writes); see `special_id`.
    extra: every other key (`inputs`, `spm_model` or `tokenizer_file`, the reading options,
      `source`, `runner`, ...), as read.
  """

  KEY: ClassVar[str] = "metadata"
  FIELDS: ClassVar[dict[str, str]] = {"tokenizer": "record", "chat": "record", "bos_id": "int",
                                      "eos_id": "int", "pad_id": "int"}
  PARTS: ClassVar[dict[str, type[_Record]]] = {"tokenizer": TokenizerRecord, "chat": ChatRecord}

  tokenizer: TokenizerRecord | None = None
  chat: ChatRecord | None = None
  bos_id: int | None = None
  eos_id: int | None = None
  pad_id: int | None = None
  extra: Mapping[str, Any] = _none()
  order: tuple[str, ...] = _keep()

  @classmethod
  def _field(cls, name: str, value: Any, *, key: str, where: str) -> Any:
    part = cls.PARTS.get(name)
    if part is None:
      return super()._field(name, value, key=key, where=where)
    return None if value is None else part.parse(value, key=f"{key}.{name}", where=where)

  @classmethod
  def from_metadata(cls, metadata: Any, *, where: str | os.PathLike[str]) -> DatasetRecord:
    """The record of a manifest's `metadata` object (None: no metadata, an empty record).

    Raises:
      ShardFormatError: naming `where` and the key of a field of the wrong type.
    """
    return cls.parse({} if metadata is None else metadata, key=cls.KEY, where=where)

  @classmethod
  def from_manifest(cls, manifest: Any, *, where: str | os.PathLike[str]) -> DatasetRecord:
    """The record of a parsed manifest (`segpack.shards.format.read_manifest`); `where` names
    the manifest file in errors.

    Raises:
      ShardFormatError: the manifest is not an object, or a field of its metadata has the wrong
        type (one line naming `where` and the key, e.g. `metadata.tokenizer.bos_id`).
    """
    if not isinstance(manifest, Mapping):
      raise ShardFormatError(f"{os.fspath(where)}: corrupt manifest, expected an object, got "
                             f"{type(manifest).__name__}")
    return cls.from_metadata(manifest.get("metadata"), where=where)

  def to_metadata(self) -> dict[str, Any]:
    """The manifest's `metadata` object of this record (JSON-ready; keys in the order read)."""
    return self.to_dict()

  def special_id(self, name: str) -> int | None:
    """`name` ("bos_id", "eos_id" or "pad_id") as the packing pipeline reads it: the metadata's
    own key, else the tokenizer's; None when neither gives one."""
    if name not in SPECIAL_IDS:
      raise ArgumentError(f"special_id: name must be one of {SPECIAL_IDS}, got {name!r}")
    own = getattr(self, name)
    if own is not None or self.tokenizer is None:
      return own
    return getattr(self.tokenizer, name)


def stored_metadata(metadata: Mapping[str, Any] | None, *, where: str | os.PathLike[str],
                    **parts: Any) -> dict[str, Any]:
  """The `metadata` a manifest stores: `metadata` with `parts` set (`tokenizer=tokenizer.
  describe()`, `chat=encoder.describe()`, `runner="beam"`, ...), read through `DatasetRecord` and
  written back by `to_metadata`: what every writer of a manifest stores. A key of `metadata`
  keeps its place; a new one goes last, in the order given.

  Raises:
    ShardFormatError: a field of the wrong type, naming `where` (the manifest to be written) and
      the key.
  """
  return DatasetRecord.from_metadata(dict(metadata or {}, **parts), where=where).to_metadata()

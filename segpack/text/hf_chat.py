"""Chat data rendered with a tokenizer's own chat template (transformers' `apply_chat_template`).

`segpack tokenize --format chat --tokenizer hf:DIR` uses `HfChatTemplate` when DIR holds a chat
template (`chat_template.jinja`, `chat_template.json`, or `chat_template` in
`tokenizer_config.json`); segpack's own `chat.ChatTemplate` stays the renderer of tokenizers
without one. The template is the model's, run by transformers (extra `segpack[hf]`; never
downloaded): the tokens are exactly `apply_chat_template(messages, tokenize=True)`'s, BOS and
end-of-turn tokens included, so the packing pipeline adds no BOS/EOS to such a dataset
(manifest `metadata.chat.add_bos_eos: false`).

The dataset keeps copies of the tokenizer and template files (`COPY_NAMES`), with their SHA-256
in the manifest; `for_dataset` loads a chat dataset's renderer from them alone and refuses a
damaged or missing copy by name (`DatasetRendererError`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segpack import files
from segpack import shards
from segpack.errors import ArgumentError, UserError
from segpack.shards.format import read_manifest
from segpack.shards.record import DatasetRecord, TokenizerRecord
from segpack.text import chat
from segpack.text import chat_layout
from segpack.text import hf
from segpack.text import tokenizer_spec
from segpack.text.chat import ChatFormatError

__all__ = ["COPY_NAMES", "DatasetRendererError", "HfChatTemplate", "TEMPLATE_FILES", "for_dataset",
           "has_template", "template_file", "validate_hf_messages"]

# The files of a tokenizer directory that hold only a chat template (`template_file`).
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# The tokenizer and template files a dataset keeps copies of (those present in the source).
COPY_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "tokenizer.model", "vocab.json", "merges.txt")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# `metadata.tokenizer.type` of a manifest -> the kind of a tokenizer spec.
_KINDS = {"sentencepiece": "spm", "hf": "hf"}


class DatasetRendererError(UserError, ValueError):
  """A chat dataset's renderer cannot be loaded: its manifest or a file copy is missing or
  damaged (the message names the file)."""


def _transformers() -> tuple[Any, Any]:
  """`(transformers, its chat_template_utils)`, or an ImportError naming the extra."""
  try:
    import transformers  # optional: only a tokenizer's own chat template needs it (segpack[hf])
    from transformers.utils import chat_template_utils  # optional: as above
  except ImportError as e:
    raise ImportError("rendering chat data with the tokenizer's own chat template needs the "
                      "`transformers` package: pip install 'segpack[hf]'") from e
  return transformers, chat_template_utils


def _sha256(path: Path) -> str:
  return "sha256:" + files.sha256_file(path)


def _json_template(path: Path, key: str = "chat_template") -> Any:
  """The `key` of the JSON object in `path` (None when unreadable, not an object or absent)."""
  try:
    found = json.loads(path.read_text("utf-8"))
  except (OSError, ValueError):
    return None
  return found.get(key) if isinstance(found, dict) else None


def template_file(directory: str | Path) -> Path | None:
  """The file holding the chat template of the tokenizer directory `directory`, or None when
  there is none: the one rule of "this directory holds a chat template".

  In order: `chat_template.jinja` (transformers' own file, which it prefers),
  `chat_template.json` (`{"chat_template": "..."}`, as transformers saves a processor's),
  `tokenizer_config.json` holding a `chat_template`.
  """
  jinja, in_json = (Path(directory) / name for name in TEMPLATE_FILES)
  if jinja.is_file():
    return jinja
  for path in (in_json, Path(directory) / hf.CONFIG_NAME):
    if _json_template(path):
      return path
  return None


def has_template(directory: str | Path) -> bool:
  """Whether the tokenizer directory `directory` holds a chat template (`template_file`)."""
  return template_file(directory) is not None


def validate_hf_messages(messages: Any, *, where: str, train_on: str = "assistant",
                         control: re.Pattern[str] | None = None) -> list[dict[str, Any]]:
  """Checks one conversation for a model's own template; returns the messages as dicts.

  Any role and any extra key (`tool_calls`, `name`, `tool_call_id`, ...) is passed on: the
  template decides what it renders or refuses. Refused here: not a non-empty list of objects, a
  role that is not a non-empty string, a content that is not a string (null only for an assistant
  message with `tool_calls`), a content holding a control token (`control`: the tokenizer would
  read it as a turn boundary), and no assistant message unless `train_on="all"`.

  Raises:
    ChatFormatError: naming `where`, the message index, its role and the field.
  """
  if train_on not in chat.TRAIN_ON:
    raise ArgumentError(f"train_on must be one of {chat.TRAIN_ON}, got {train_on!r}")
  if not isinstance(messages, list) or not messages:
    raise ChatFormatError(f"{where}: messages must be a non-empty list, got {messages!r:.80}")
  for k, message in enumerate(messages):
    at = f"{where}: messages[{k}]"
    if not isinstance(message, dict):
      raise ChatFormatError(f"{at} must be an object with role and content, got {message!r:.80}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
      raise ChatFormatError(f"{at}: role must be a non-empty string, got {role!r:.80}")
    content = message.get("content")
    if content is None:
      if role != "assistant" or not message.get("tool_calls"):
        raise ChatFormatError(f"{at} (role {role!r}): content must be a string (null only for "
                              f"an assistant message with tool_calls), got None")
    elif not isinstance(content, str):
      raise ChatFormatError(f"{at} (role {role!r}): content must be a string, got "
                            f"{type(content).__name__}: {content!r:.80}")
    elif control is not None and (found := control.search(content)):
      raise ChatFormatError(f"{at} (role {role!r}): content contains the special token "
                            f"{found.group()!r}, which the tokenizer reads as a control token")
  if train_on != "all" and not any(m.get("role") == "assistant" for m in messages):
    raise ChatFormatError(f"{where}: no assistant message, so nothing would be trained with "
                          f"train_on={train_on!r}")
  return [dict(m) for m in messages]


def _pattern(tokens: Sequence[str]) -> re.Pattern[str] | None:
  """A pattern matching any of `tokens`, longest first (None for no token)."""
  tokens = sorted({t for t in tokens if t.strip()}, key=len, reverse=True)
  return re.compile("|".join(map(re.escape, tokens))) if tokens else None


class HfChatTemplate:
  """Renders conversations with a tokenizer's own chat template into (tokens, loss mask).

  Algorithm for one conversation of `n` messages (`render(m)` is transformers'
  `apply_chat_template(m, tokenize=False)`):
    1. Tokens: `apply_chat_template(messages, tokenize=True)`; they must equal the tokenizer's
       encoding of the rendered text (no special tokens added), whose character offsets give
       every token's place.
    2. Prefix stability: `A_k = render(messages[:k+1])` must begin the whole render for every
       k, and the tokens of each `A_k` must begin its tokens; otherwise the conversation is
       refused (`ChatFormatError`), never mis-masked.
    3. Mask, template with `{% generation %}` markers: transformers' own
       `return_assistant_tokens_mask`.
    4. Mask, any other template: for a trained assistant message `k`, the prompt
       `H_k = render(messages[:k], add_generation_prompt=True)` when it begins `A_k` (else
       `A_{k-1}`, with the content searched exactly, else stripped). The trained characters run
       from the end of `H_k` (or the content start) through the last special or added token
       after the content; a token is trained when its characters overlap them. Text after that
       token (ChatML's newline) and the next message's header are not trained.
    5. `train_on`: "assistant" every assistant message, "last_assistant" the last one, "all"
       every token. Trained tokens are counted per role (`chat_layout.role_counts`).

  Example (ChatML): user "Hi", assistant "Hello" render as
  `<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n`;
  `H_1` ends with `<|im_start|>assistant\\n`, so `Hello<|im_end|>` is trained and the final
  newline is not.
  """

  def __init__(self, directory: str | Path, *, train_on: str = "assistant"):
    """Loads the tokenizer of `directory` with transformers (local files only).

    Args:
      directory: a Hugging Face tokenizer directory holding a chat template.
      train_on: "assistant" (default), "last_assistant" or "all".

    Raises:
      ValueError: no chat template, or transformers cannot load the tokenizer (naming it).
      ImportError: transformers is not installed (naming the extra).
    """
    if train_on not in chat.TRAIN_ON:
      raise ArgumentError(f"train_on must be one of {chat.TRAIN_ON}, got {train_on!r}")
    self.directory = Path(directory)
    source = template_file(self.directory)
    if source is None:
      raise ArgumentError(f"{self.directory}: no chat template (chat_template.jinja, "
                          f"chat_template.json, or chat_template in {hf.CONFIG_NAME})")
    transformers, self._utils = _transformers()
    try:
      self._hf = transformers.AutoTokenizer.from_pretrained(str(self.directory),
                                                            local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ArgumentError(f"{self.directory}: transformers cannot load the tokenizer: "
                       f"{' '.join(str(e).split())}") from e
    if source.name == TEMPLATE_FILES[1]:  # transformers reads it for processors, not tokenizers
      self._hf.chat_template = _json_template(source)
    self.tokenizer = hf.HfTokenizer(self.directory)
    self.train_on = train_on
    self.template = self._hf.get_chat_template()
    self.template_file = source.name
    self.generation_markers = bool(_GENERATION.search(self.template))
    self.files = {n: _sha256(self.directory / n) for n in COPY_NAMES
                  if (self.directory / n).is_file()}
    added = self._hf.added_tokens_decoder.values()
    self._control = _pattern([t.content for t in added if t.special] +
                             list(self._hf.all_special_tokens))
    self._markers = _pattern([t.content for t in added] + list(self._hf.all_special_tokens))
    self._preamble = self._empty_render()

  def _empty_render(self) -> str:
    """The template's text for no message ("" when it does not render one)."""
    try:
      rendered, _ = self._utils.render_jinja_template(
          conversations=[[]], chat_template=self.template, **self._hf.special_tokens_map)
      return rendered[0]
    except Exception:  # noqa: BLE001  # most templates read messages[0]: no text of their own
      return ""

  def describe(self) -> dict[str, Any]:
    """The manifest's `metadata.chat` for data rendered by this template."""
    return {"renderer": "hf", "train_on": self.train_on, "template_file": self.template_file,
            "template_sha256": self.files[self.template_file],
            "template_text_sha256": "sha256:" + hashlib.sha256(
                self.template.encode("utf-8")).hexdigest(),
            "generation_markers": self.generation_markers, "add_bos_eos": False,
            "files": dict(self.files)}

  def keep_files(self, output: str | Path) -> None:
    """Copies the tokenizer and template files into the dataset directory `output` (atomic per
    file; a copy already equal is kept)."""
    for name, digest in self.files.items():
      dest = Path(output) / name
      if dest.is_file() and _sha256(dest) == digest:
        continue
      files.atomic_write_bytes(dest, (self.directory / name).read_bytes())

  def _render(self, messages: list[dict[str, Any]], *, where: str, prompt: bool = False) -> str:
    try:
      return self._hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=prompt)
    except Exception as e:  # noqa: BLE001  # the template's raise_exception, Jinja errors
      raise ChatFormatError(f"{where}: the chat template of {self.directory} does not render "
                            f"messages[:{len(messages)}]: {' '.join(str(e).split())}") from e

  def _prompt(self, messages: list[dict[str, Any]], *, where: str) -> str | None:
    try:
      return self._render(messages, where=where, prompt=True)
    except ChatFormatError:
      return None

  def _template_end(self, text: str) -> int:
    """The length of the template's own text before the first message."""
    if self._preamble and text.startswith(self._preamble):
      return len(self._preamble)
    bos = self._hf.bos_token
    return len(bos) if bos and text.startswith(bos) else 0

  def encode(self, messages: Sequence[Mapping[str, Any]], *,
             where: str = "conversation") -> tuple[np.ndarray, np.ndarray]:
    """Validates and encodes one conversation: (int64 token ids, uint8 loss mask)."""
    ids, mask, _ = self.encode_counted(messages, where=where)
    return ids, mask

  def encode_counted(self, messages: Sequence[Mapping[str, Any]], *, where: str = "conversation",
                     ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """`encode`, plus the trained tokens per role (`chat_layout.role_counts`).

    Raises:
      ChatFormatError: naming `where`: invalid messages, a template error, a conversation that
        is not prefix-stable, content that cannot be located, or no trained token.
    """
    messages = validate_hf_messages(messages, where=where, train_on=self.train_on,
                                    control=self._control)
    n = len(messages)
    renders = [self._render(messages[:k + 1], where=where) for k in range(n)]
    assistants = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    trained = {"assistant": assistants, "last_assistant": assistants[-1:], "all": []}
    trained = [] if self.generation_markers else trained[self.train_on]
    prompts = {k: self._prompt(messages[:k], where=where) for k in trained if k}
    lay = chat_layout.layout(renders, prompts, messages, trained=trained,
                             template_end=self._template_end(renders[-1]),
                             markers=self._markers, where=where)
    enc = self._hf(lay.text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = np.asarray(enc["input_ids"], np.int64), np.asarray(enc["offset_mapping"])
    out = self._hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=self.generation_markers)
    if list(out["input_ids"]) != ids.tolist():
      raise ChatFormatError(f"{where}: apply_chat_template's tokens differ from the tokens of "
                            f"its rendered text; the conversation cannot be masked")
    self._check_prefix_tokens(ids, lay, where=where)
    if self.generation_markers:
      mask = np.asarray(out["assistant_masks"], np.uint8)
      if self.train_on == "last_assistant" and assistants:
        last = chat_layout.region_mask(offsets, region=lay.region(assistants[-1]))
        mask &= last.astype(np.uint8)
    else:
      mask = chat_layout.overlap_mask(offsets, spans=lay.spans)
    if self.train_on == "all":
      mask = np.ones(ids.size, np.uint8)
    elif not mask.any():
      raise ChatFormatError(f"{where}: no token is trained with train_on={self.train_on!r} (the "
                            f"template writes nothing of the assistant messages to train)")
    counts = chat_layout.role_counts(offsets, mask, lay=lay,
                                      roles=[m["role"] for m in messages])
    return ids, mask.astype(np.uint8), counts

  def _check_prefix_tokens(self, ids: np.ndarray, lay: chat_layout.Layout, *, where: str) -> None:
    """Refuses a conversation whose prefix renders tokenize otherwise than its start (a token
    would cross a message boundary, or the model would be prompted with other tokens than it
    was trained after)."""
    if not lay.prefixes:
      return
    full = ids.tolist()
    texts = [text for _, text in lay.prefixes]
    for (name, text), got in zip(lay.prefixes,
                                 self._hf(texts, add_special_tokens=False)["input_ids"]):
      if full[:len(got)] != list(got):
        raise ChatFormatError(
            f"{where}: the chat template is not prefix-stable in tokens: {name} (ending "
            f"{text[-30:]!r}) ends with the tokens {list(got)[-3:]}, the whole conversation has "
            f"{full[max(len(got) - 3, 0):len(got)]} there (a token merges across the boundary, "
            f"e.g. a content that begins with whitespace); refused")

  def prompt_ids(self, messages: Sequence[Mapping[str, Any]], *,
                 where: str = "prompt") -> list[int]:
    """The conversation rendered with the generation prompt, as token ids (the BOS included
    when the template writes it): what the model continues with an assistant answer."""
    messages = validate_hf_messages(messages, where=where, train_on="all", control=self._control)
    self._render(messages, where=where, prompt=True)  # a template error as a ChatFormatError
    out = self._hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                       add_generation_prompt=True)
    return [int(i) for i in out["input_ids"]]

  @functools.cached_property
  def stop_ids(self) -> tuple[int, ...]:
    """The EOS id and the end-of-turn token the template writes after an assistant message (the
    first special or added token after the content of a probe conversation)."""
    out = [] if self._hf.eos_token_id is None else [int(self._hf.eos_token_id)]
    probes = ([{"role": "user", "content": "Hi"}],
              [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}])
    for head in probes:
      try:
        text = self._render(head + [{"role": "assistant", "content": "Hello"}], where="stop_ids")
      except ChatFormatError:
        continue
      at = text.rfind("Hello")
      found = self._markers.search(text, at) if self._markers and at >= 0 else None
      if found is not None:
        out.append(int(self._hf.convert_tokens_to_ids(found.group())))
      break
    return tuple(dict.fromkeys(out))

  def __repr__(self) -> str:
    return f"HfChatTemplate({str(self.directory)!r}, train_on={self.train_on!r})"


def _check_copies(directory: Path, recorded: Mapping[str, str]) -> None:
  """Refuses a dataset whose copy of a file of `recorded` ({name: sha256}) is missing or damaged."""
  if not recorded:
    raise DatasetRendererError(f"{directory / shards.MANIFEST_NAME}: metadata.chat.files names "
                               f"no tokenizer or template file")
  for name, want in recorded.items():
    path = directory / name
    if not path.is_file():
      raise DatasetRendererError(f"{path}: missing; the dataset's copy of its tokenizer and chat "
                                 f"template is needed to render its conversations")
    got = _sha256(path)
    if got != want:
      raise DatasetRendererError(f"{path}: damaged or replaced ({got}; the manifest records "
                                 f"{want}); re-tokenize the dataset with --overwrite")


def _dataset_tokenizer(directory: Path,
                       described: TokenizerRecord | None) -> tokenizer_spec.Tokenizer:
  """The tokenizer a segpack-template chat dataset names (in it, or beside it for the built-in
  chat corpus), checked against the manifest's fingerprint."""
  described = described or TokenizerRecord()
  kind, name = _KINDS.get(described.type), described.model_file
  if kind is None or name is None:
    raise DatasetRendererError(f"{directory / shards.MANIFEST_NAME}: metadata.tokenizer names no "
                               f"tokenizer file (type {described.type!r}, model_file "
                               f"{name!r})")
  path = next((p for p in (directory / name, directory.parent / name) if p.is_file()),
              directory / name)
  try:
    tokenizer = tokenizer_spec.from_spec(f"{kind}:{path.resolve()}")
  except (OSError, ValueError) as e:
    raise DatasetRendererError(f"{path}: the dataset's tokenizer cannot be loaded: {e}") from e
  if described.fingerprint not in (None, tokenizer.fingerprint):
    raise DatasetRendererError(f"{path}: damaged or replaced (fingerprint {tokenizer.fingerprint};"
                               f" the manifest records {described.fingerprint})")
  return tokenizer


def for_dataset(dataset_dir: str | Path) -> chat.ChatEncoder | HfChatTemplate | None:
  """The renderer a chat dataset was written with; None for a dataset that is not chat.

  A dataset rendered with a model's own template (`metadata.chat.renderer == "hf"`) gives an
  `HfChatTemplate` loaded from the copies inside the dataset (each checked against its SHA-256);
  one rendered with segpack's template gives a `chat.ChatEncoder` of the recorded template and
  the dataset's tokenizer. Either has `encode`, `prompt_ids` and `stop_ids`.

  Raises:
    DatasetRendererError: the manifest is unreadable, or a copy is missing or damaged (naming it).
    ImportError: a model's template without transformers installed (naming the extra).
  """
  directory = Path(dataset_dir)
  path = directory / shards.MANIFEST_NAME
  try:
    record = DatasetRecord.from_manifest(read_manifest(path), where=path)
  except shards.ShardFormatError as e:
    raise DatasetRendererError(str(e)) from e
  described = record.chat
  if described is None or not described.to_dict():
    return None
  train_on = described.train_on or "assistant"
  if described.own_template:
    _check_copies(directory, described.files or {})
    try:
      renderer = HfChatTemplate(directory, train_on=train_on)
    except (OSError, ValueError) as e:
      raise DatasetRendererError(f"{directory}: its chat template cannot be loaded: {e}") from e
    recorded = described.template_text_sha256
    if recorded is not None and renderer.describe()["template_text_sha256"] != recorded:
      raise DatasetRendererError(f"{directory / renderer.template_file}: its chat template is not "
                                 f"the one the dataset was rendered with ({recorded})")
    return renderer
  try:
    template = chat.ChatTemplate(**(described.template or {}))
  except (TypeError, ValueError) as e:
    raise DatasetRendererError(f"{path}: metadata.chat.template is not a chat template: "
                               f"{e}") from e
  tokenizer = _dataset_tokenizer(directory, record.tokenizer)
  return chat.ChatEncoder(tokenizer, template=template, train_on=train_on)

"""The renderer a chat dataset was written with, loaded from the dataset alone.

A dataset rendered with a model's own template keeps copies of the tokenizer and template files
(`files.COPY_NAMES`) with their SHA-256 in the manifest; `for_dataset` loads its renderer from them
and refuses a damaged or missing copy by name (`DatasetRendererError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from segpack import shards
from segpack.errors import UserError
from segpack.shards.format import read_manifest
from segpack.shards.record import ChatRecord, DatasetRecord, TokenizerRecord
from segpack.text import chat
from segpack.text.chat.hf_chat.files import sha256 as _sha256
from segpack.text.chat.hf_chat.options import ChatOptions
from segpack.text.chat.hf_chat.template import HfChatTemplate
from segpack.text.tokenizers import spec as tokenizer_spec

__all__ = ["DatasetRendererError", "for_dataset", "options_of"]

# `metadata.tokenizer.type` of a manifest -> the kind of a tokenizer spec.
_KINDS = {"sentencepiece": "spm", "hf": "hf"}


class DatasetRendererError(UserError, ValueError):
  """A chat dataset's renderer cannot be loaded: its manifest or a file copy is missing or
  damaged (the message names the file)."""


def options_of(described: ChatRecord) -> ChatOptions:
  """The rendering choices a dataset's `metadata.chat` records (the defaults for a dataset
  written before they were recorded)."""
  given = {k: v for k, v in (("turns", described.turns), ("reasoning", described.reasoning),
                             ("date", described.date)) if v is not None}
  return ChatOptions(**given)


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
      renderer = HfChatTemplate(directory, train_on=train_on, options=options_of(described))
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

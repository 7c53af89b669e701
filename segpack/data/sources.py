"""What `pack_dataset` and `pack_minibatches` read from their source: documents, their lengths,
special token ids, the loss mask."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from segpack import shards
from segpack.data.options import PipelineConfigError, SpecialTokens
from segpack.shards.record import DatasetRecord


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A source ready to pack.

  Attributes:
    source: the opened source (a `ShardSource` for a dataset directory).
    lengths: int64 `[num_docs]` token counts.
    special: the resolved special tokens (ints; -1 for an unused BOS/EOS id).
    loss_mask: whether rows apply the source's loss mask.
  """

  source: Any
  lengths: np.ndarray
  special: SpecialTokens
  loss_mask: bool


def prepare(source: Any, *, fn: str, special_tokens: SpecialTokens,
            loss_mask: bool | None) -> Prepared:
  """Opens `source`, reads its lengths, resolves the special ids and the loss mask.

  A source whose documents hold their chat template's BOS and end-of-turn tokens already
  (`template_writes_special_tokens`) gets no BOS/EOS, whatever `special_tokens` asks: the
  resolved `Prepared.special` has `add_bos=add_eos=False`, and plans count no extra slot.

  Raises:
    PipelineConfigError: the source is not usable, holds no documents, lacks a needed special id
      or a requested loss mask (the message starts with `fn`).
  """
  source = open_source(source, fn=fn)
  if template_writes_special_tokens(source, fn=fn):
    special_tokens = dataclasses.replace(special_tokens, add_bos=False, add_eos=False)
  special = dataclasses.replace(
      special_tokens,
      bos_id=special_id(source, "bos_id", special_tokens.bos_id, special_tokens.add_bos, fn=fn),
      eos_id=special_id(source, "eos_id", special_tokens.eos_id, special_tokens.add_eos, fn=fn),
      pad_id=int(special_tokens.pad_id))
  lengths = document_lengths(source, fn=fn)
  if lengths.size == 0:
    raise PipelineConfigError(f"{fn}: source {source!r:.200} holds no documents")
  has_mask = bool(getattr(source, "has_loss_mask", False))
  if loss_mask is None:
    loss_mask = has_mask
  elif loss_mask and not has_mask:
    raise PipelineConfigError(
        f"{fn}: loss_mask=True but the source {source!r:.200} has no loss mask "
        f"(has_loss_mask is not true)")
  return Prepared(source=source, lengths=lengths, special=special, loss_mask=bool(loss_mask))


def open_source(source: Any, *, fn: str = "pack_dataset") -> Any:
  """Opens a dataset directory as a ShardSource; passes other sources through."""
  if isinstance(source, (str, os.PathLike)):
    return shards.ShardSource(os.fspath(source))
  if isinstance(source, (bytes, np.ndarray)) or not hasattr(source, "__getitem__"):
    raise PipelineConfigError(
        f"{fn}: source must be a dataset directory, a ShardSource or a random-access "
        f"sequence of 1-D integer arrays, got {type(source).__name__}")
  return source


def dataset_record(source: Any) -> DatasetRecord | None:
  """The record of the dataset `source` reads (`ShardSource.record`, or the record of a source's
  `manifest` dict, such as a document subset's); None for a source without a manifest.

  Raises:
    ShardFormatError: a manifest whose metadata has a field of the wrong type (naming it).
  """
  record = getattr(source, "record", None)
  if isinstance(record, DatasetRecord):
    return record
  manifest = getattr(source, "manifest", None)
  if not isinstance(manifest, dict):
    return None
  path = getattr(source, "path", None)
  where = (os.path.join(os.fspath(path), shards.MANIFEST_NAME) if path is not None
           else f"{type(source).__name__}.manifest")
  return DatasetRecord.from_manifest(manifest, where=where)


def _chat_flags(source: Any) -> set[bool]:
  """Whether each dataset under `source` (itself, a document subset's parents or a mixture's
  sources) says that packing adds no BOS/EOS (manifest `metadata.chat.add_bos_eos: false`)."""
  parents = getattr(source, "parents", None) or [
      getattr(m, "source", None) for m in getattr(source, "sources", None) or ()]  # a Mixture
  if parents:
    return set().union(*(_chat_flags(p) for p in parents))
  record = dataset_record(source)
  return {record is not None and record.chat is not None and not record.chat.adds_bos_eos}


def template_writes_special_tokens(source: Any, *, fn: str = "pack_dataset") -> bool:
  """Whether the documents of `source` already hold the BOS and end-of-turn tokens of the chat
  template they were rendered with (`segpack tokenize --format chat` with a tokenizer's own
  template), so that packing must add no BOS/EOS to them.

  Raises:
    PipelineConfigError: a mixture or subset of such datasets and others.
  """
  flags = _chat_flags(source)
  if len(flags) > 1:
    raise PipelineConfigError(
        f"{fn}: the source {source!r:.200} mixes datasets whose chat template writes BOS and "
        f"end-of-turn tokens itself (no BOS/EOS added) with datasets that need them added; "
        f"pack them separately")
  return flags == {True}


def document_lengths(source: Any, *, fn: str = "pack_dataset") -> np.ndarray:
  """`source.lengths` when present, else one pass over the source (checking every document)."""
  lengths = getattr(source, "lengths", None)
  if lengths is not None:
    return np.asarray(lengths, dtype=np.int64)
  try:
    n = len(source)
  except TypeError as e:
    raise PipelineConfigError(
        f"{fn}: source {type(source).__name__} has no len(); it must be random-access"
    ) from e
  out = np.empty(n, dtype=np.int64)
  for d in range(n):
    doc = np.asarray(source[d])
    if doc.ndim != 1 or not np.issubdtype(doc.dtype, np.integer):
      raise PipelineConfigError(
          f"{fn}: source[{d}] must be a 1-D integer array, got dtype {doc.dtype} and "
          f"shape {doc.shape}")
    out[d] = doc.shape[0]
  return out


def _source_special_id(source: Any, name: str) -> int | None:
  """`name` ("bos_id"/"eos_id") as the source carries it: an attribute, a `tokenizer` attribute
  or dict, or the dataset's record (`DatasetRecord.special_id`)."""
  value = getattr(source, name, None)
  if value is not None:
    return value
  tokenizer = getattr(source, "tokenizer", None)
  value = (tokenizer.get(name) if isinstance(tokenizer, dict)
           else getattr(tokenizer, name, None))
  if value is not None:
    return value
  record = dataset_record(source)
  return None if record is None else record.special_id(name)


def special_id(source: Any, name: str, given: int | None, needed: bool, *,
               fn: str = "pack_dataset") -> int:
  """The id given by the caller, else the source's tokenizer's, else an error when needed;
  -1 when not needed (a given id is still checked)."""
  if given is None:
    given = _source_special_id(source, name)
  if given is None:
    if needed:
      flag = "add_bos" if name == "bos_id" else "add_eos"
      raise PipelineConfigError(
          f"{fn}: special_tokens.{flag}=True but special_tokens.{name} is None and the source "
          f"carries no tokenizer {name}; pass SpecialTokens({name}=...) or {flag}=False")
    return -1
  if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given < 0:
    raise PipelineConfigError(
        f"{fn}: special_tokens.{name} must be a non-negative int, got {given!r}")
  vocab = getattr(source, "vocab_size", None)
  if needed and vocab is not None and given >= vocab:
    raise PipelineConfigError(
        f"{fn}: special_tokens.{name}={given} is outside the source's vocabulary "
        f"(vocab_size={vocab})")
  return int(given) if needed else -1

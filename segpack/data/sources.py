"""What `pack_dataset` reads from its source: documents, their lengths, special token ids."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from segpack import shards
from segpack.data.options import PipelineConfigError


def open_source(source: Any) -> Any:
  """Opens a dataset directory as a ShardSource; passes other sources through."""
  if isinstance(source, (str, os.PathLike)):
    return shards.ShardSource(os.fspath(source))
  if isinstance(source, (bytes, np.ndarray)) or not hasattr(source, "__getitem__"):
    raise PipelineConfigError(
        "pack_dataset: source must be a dataset directory, a ShardSource or a random-access "
        f"sequence of 1-D integer arrays, got {type(source).__name__}")
  return source


def document_lengths(source: Any) -> np.ndarray:
  """`source.lengths` when present, else one pass over the source (checking every document)."""
  lengths = getattr(source, "lengths", None)
  if lengths is not None:
    return np.asarray(lengths, dtype=np.int64)
  try:
    n = len(source)
  except TypeError as e:
    raise PipelineConfigError(
        f"pack_dataset: source {type(source).__name__} has no len(); it must be random-access"
    ) from e
  out = np.empty(n, dtype=np.int64)
  for d in range(n):
    doc = np.asarray(source[d])
    if doc.ndim != 1 or not np.issubdtype(doc.dtype, np.integer):
      raise PipelineConfigError(
          f"pack_dataset: source[{d}] must be a 1-D integer array, got dtype {doc.dtype} and "
          f"shape {doc.shape}")
    out[d] = doc.shape[0]
  return out


def _source_special_id(source: Any, name: str) -> int | None:
  """`name` ("bos_id"/"eos_id") as the source carries it: an attribute, a `tokenizer` attribute
  or dict, or the shard manifest's metadata (top level or its "tokenizer" dict)."""
  value = getattr(source, name, None)
  if value is not None:
    return value
  places = [getattr(source, "tokenizer", None)]
  manifest = getattr(source, "manifest", None)
  metadata = manifest.get("metadata") if isinstance(manifest, dict) else None
  if isinstance(metadata, dict):
    places += [metadata, metadata.get("tokenizer")]
  for place in places:
    value = place.get(name) if isinstance(place, dict) else getattr(place, name, None)
    if value is not None:
      return value
  return None


def special_id(source: Any, name: str, given: int | None, needed: bool) -> int:
  """The id given by the caller, else the source's tokenizer's, else an error when needed."""
  if given is None:
    given = _source_special_id(source, name)
  if given is None:
    if needed:
      flag = "add_bos" if name == "bos_id" else "add_eos"
      raise PipelineConfigError(
          f"pack_dataset: {flag}=True but {name} was not given and the source carries no "
          f"tokenizer {name}; pass {name}=... or {flag}=False")
    return -1
  if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given < 0:
    raise PipelineConfigError(f"pack_dataset: {name} must be a non-negative int, got {given!r}")
  vocab = getattr(source, "vocab_size", None)
  if needed and vocab is not None and given >= vocab:
    raise PipelineConfigError(
        f"pack_dataset: {name}={given} is outside the source's vocabulary (vocab_size={vocab})")
  return int(given)

"""Some documents of a source, renumbered, and the held-out split of a data set by document id.

`DocumentSubset(parent, ids)` is a random-access source of the parent's documents `ids`, in that
order: `pack_dataset` packs it like any source, and for a shard dataset the row builder still
copies slices straight from the memory-mapped shard files (`segpack.shards.reader` maps the ids).

`held_out_split(source, share=...)` splits a source into training and held-out documents by a
stable hash of each document's index, so the split is the same on every process count, seed and
machine, and a document is never in both.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from segpack.data.options import PipelineConfigError
from segpack.data.sources import document_lengths, open_source

__all__ = ["DocumentSubset", "held_out_mask", "held_out_split"]

_HASH_BITS = 24


def held_out_mask(num_docs: int, *, share: float, salt: int = 0) -> np.ndarray:
  """bool `[num_docs]`: the documents held out, by a stable hash of their index.

  Document `d` is held out when `splitmix64(d + salt * 2**32) mod 2**24 < share * 2**24`: about
  `share` of the documents, spread over the whole data set (not its tail), and the same for a
  document whatever the order in which it is asked about.

  Args:
    num_docs: documents in the source.
    share: the held-out share, in `[0, 1)`.
    salt: another split of the same documents (0: the trainer's).
  """
  if not isinstance(share, (float, int)) or isinstance(share, bool) or not 0 <= share < 1:
    raise PipelineConfigError(f"held_out_mask: share must be a number in [0, 1), got {share!r}")
  x = np.arange(num_docs, dtype=np.uint64) + np.uint64(int(salt) << 32)
  with np.errstate(over="ignore"):  # splitmix64 works modulo 2**64
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
  return (x & np.uint64((1 << _HASH_BITS) - 1)) < np.uint64(int(share * (1 << _HASH_BITS)))


def _integers(values: Any) -> np.ndarray:
  """`values` as a 1-D array, its integer dtype kept (int32 ids take half of int64's memory);
  anything else as int64."""
  array = np.asarray(values)
  return array if array.dtype.kind in "iu" else array.astype(np.int64)


def _group_bounds(parent_index: np.ndarray, parents: int) -> list[int]:
  """Where each parent's documents start in a `parent_index` sorted by parent, and its end
  (searched in the array's own dtype: a uint8 index is not widened to int64 to search it)."""
  values = np.arange(parents).astype(parent_index.dtype)
  return np.searchsorted(parent_index, values).tolist() + [int(parent_index.size)]


class DocumentSubset:
  """Documents `ids` of a parent source (or of several), as documents `0 .. len(ids) - 1`.

  Lengths, loss masks and the tokenizer's ids come from the parents (the tokenizer's from the
  first). The fingerprint combines the parents' with the ids, so the plan cache beside a shard
  dataset keeps one plan per subset. With several parents, `parent_index[j]` says which parent
  document `j` comes from; documents of a parent without a loss mask are trained on every token
  when another parent has one.

  Example: `DocumentSubset(src, ids=np.array([4, 1]))[1]` is `src[1]`, and its `lengths` are
  `src.lengths[[4, 1]]`; `DocumentSubset([a, b], ids=[0, 0], parent_index=[1, 0])[0]` is `b[0]`.
  """

  def __init__(self, parent: Any, *, ids: Any, name: str, parent_index: Any = None,
               lengths: Any = None):
    """A subset of `parent` (a source, or a list of sources with `parent_index`).

    Args:
      parent: a source, or the list of sources that `parent_index` picks from.
      ids: the parent document of every subset document, any integer dtype (kept).
      name: names the subset (in its fingerprint and repr).
      parent_index: with a list of parents, the parent of every subset document (any integer
        dtype, kept).
      lengths: the documents' lengths when the caller has them already (a mixture's draw
        gathers them as it draws), kept in their integer dtype; None: read from the parents.
    """
    many = parent_index is not None
    self.parents = [open_source(p, fn="DocumentSubset") for p in (parent if many else [parent])]
    self.parent = self.parents[0]
    self.parent_ids = _integers(ids)
    self.parent_index = (_integers(parent_index) if many
                         else np.zeros(self.parent_ids.size, dtype=np.int64))
    self.name = name
    given = lengths is not None
    self.lengths = _integers(lengths) if given else np.zeros(self.parent_ids.size, np.int64)
    if not self.lengths.shape == self.parent_index.shape == self.parent_ids.shape:
      raise PipelineConfigError(
          f"DocumentSubset: ids {self.parent_ids.shape}, parent_index {self.parent_index.shape} "
          f"and lengths {self.lengths.shape} must have one entry per document")
    grouped = not many or bool(np.all(self.parent_index[1:] >= self.parent_index[:-1]))
    bounds = _group_bounds(self.parent_index, len(self.parents)) if grouped else None
    for k, p in enumerate(self.parents):
      parent_lengths = document_lengths(p, fn="DocumentSubset")
      # Documents grouped by parent (a mixture's draw) are slices; others need a mask.
      where = slice(bounds[k], bounds[k + 1]) if grouped else self.parent_index == k
      ids_k = self.parent_ids[where]
      if ids_k.size and (ids_k.min() < 0 or ids_k.max() >= parent_lengths.size):
        raise PipelineConfigError(
            f"DocumentSubset: ids of parent {k} must be in [0, {parent_lengths.size}), got "
            f"[{ids_k.min()}, {ids_k.max()}]")
      if not given:
        self.lengths[where] = parent_lengths[ids_k]
    self._fingerprint: str | None = None
    for attr in ("path", "manifest", "vocab_size", "bos_id", "eos_id", "tokenizer",
                 "tokenizer_fingerprint"):
      if hasattr(self.parent, attr):
        setattr(self, attr, getattr(self.parent, attr))

  @property
  def fingerprint(self) -> str | None:
    """A hash of the parents' fingerprints and the ids (None when a parent has none); computed
    on first use (the plan cache asks for it; a mixture's draws are not cached)."""
    if self._fingerprint is None:
      prints = [getattr(p, "fingerprint", None) for p in self.parents]
      if None in prints:
        return None
      self._fingerprint = hashlib.sha256(  # the ids as int64, whatever their dtype here
          f"{'|'.join(map(str, prints))}|{self.name}|".encode()
          + self.parent_ids.astype(np.int64, copy=False).tobytes()
          + self.parent_index.astype(np.int64, copy=False).tobytes()).hexdigest()[:32]
    return self._fingerprint

  @property
  def has_loss_mask(self) -> bool:
    return any(getattr(p, "has_loss_mask", False) for p in self.parents)

  def loss_mask(self, index: int) -> np.ndarray:
    parent = self.parents[int(self.parent_index[index])]
    doc = int(self.parent_ids[index])
    if getattr(parent, "has_loss_mask", False):
      return parent.loss_mask(doc)
    return np.ones(int(self.lengths[index]), dtype=np.uint8)

  def by_parent(self) -> list["DocumentSubset"]:
    """This subset's documents of each parent, one single-parent subset per parent."""
    return [DocumentSubset(p, ids=self.parent_ids[self.parent_index == k],
                           name=f"{self.name}/{k}") for k, p in enumerate(self.parents)]

  def __len__(self) -> int:
    return int(self.parent_ids.size)

  def __getitem__(self, index: int) -> np.ndarray:
    return self.parents[int(self.parent_index[index])][int(self.parent_ids[index])]

  def __repr__(self) -> str:
    return f"DocumentSubset({self.name}: {len(self)} documents of {self.parent!r:.120})"


def held_out_split(source: Any, *, share: float,
                   salt: int = 0) -> tuple[DocumentSubset, DocumentSubset]:
  """`(train, held_out)`: the documents of `source` split by `held_out_mask`.

  Raises:
    PipelineConfigError: `share` is out of range, or either side would hold no document (the
      message names the source's document count and the share).
  """
  source = open_source(source, fn="held_out_split")
  n = document_lengths(source, fn="held_out_split").size
  held = held_out_mask(n, share=share, salt=salt)
  if held.all() or not held.any():
    raise PipelineConfigError(
        f"held_out_split: a held-out share of {share!r} of the {n} documents of "
        f"{source!r:.200} leaves {'no training' if held.all() else 'no held-out'} document; "
        f"change the share or pass held-out data of its own")
  return (DocumentSubset(source, ids=np.flatnonzero(~held), name=f"train{share}:{salt}"),
          DocumentSubset(source, ids=np.flatnonzero(held), name=f"held_out{share}:{salt}"))

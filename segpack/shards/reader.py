"""Readers of document slices for the row builder: straight from shard files, or any source.

`make_token_reader(source)` returns a `ShardTokenReader` for a shard dataset (memory-mapped token
files, one `searchsorted` per batch of pieces), a `SubsetReader` over its parent's reader for a
subset of another source (`segpack.data.subset.DocumentSubset`: it has `parent` and
`parent_ids`), and a `SequenceSliceReader` for any other random-access source;
`make_mask_reader` does the same for per-token loss masks.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from segpack.errors import ArgumentError
from segpack.shards.format import ShardFormatError


class SequenceSliceReader:
  """Reads document slices through a per-document getter: `source[d]` for tokens, or
  `source.loss_mask(d)` for per-token loss masks (any random-access source)."""

  def __init__(self, fetch: Any):
    self._fetch = fetch

  def copy(self, out: np.ndarray, doc_P: np.ndarray, lo_P: np.ndarray, hi_P: np.ndarray,
           dst_P: np.ndarray) -> None:
    """Copies `fetch(doc)[lo:hi]` to `out[dst:]` for every piece."""
    fetch = self._fetch
    for d, lo, hi, dst in zip(doc_P.tolist(), lo_P.tolist(), hi_P.tolist(), dst_P.tolist()):
      if hi > lo:
        out[dst:dst + hi - lo] = np.asarray(fetch(d))[lo:hi]


class ShardTokenReader:
  """Reads document slices straight from the token files of a `segpack.ShardSource`.

  With `kind="mask"` it reads the shards' loss-mask files (uint8, aligned with the tokens)
  instead.

  Algorithm:
    1. From the manifest (shard token file names, documents per shard) and `source.lengths`,
       compute each document's first token inside its shard file: the exclusive cumulative sum
       of the lengths, restarted at every shard (exactly the shard's offsets file, which
       `ShardSource` checked on open). 4 bytes per document (8 when a shard exceeds 2**31 tokens).
    2. Open each token file once per process as a read-only memory map, viewed as a plain ndarray
       (slicing a plain view is ~10x cheaper than slicing `np.memmap` objects); nothing is read
       until a slice is copied.
    3. For a batch of pieces, find the shards with one `searchsorted`, then copy each piece's
       slice into the output.
    4. Token ids: one vectorized maximum over the output (int32 values read as unsigned) must be
       below the manifest's `vocab_size`; when it is not, the pieces are searched one by one and
       the first id too large is a `ShardFormatError` naming the shard file, the id, its
       position and document, and the vocabulary size (the padding the caller put in the output
       may be that large too: then nothing is raised). This catches what the open-time checks
       cannot: a manifest whose `vocab_size` and `max_token` were both lowered, ids changed with
       their checksum.

  Example: shards of 2 and 1 documents with lengths [3, 2, 4] give starts [0, 3, 0]; document 2,
  tokens [1, 3) is shard 1's file slice [1, 3).
  """

  def __init__(self, source: Any, *, kind: str = "tokens"):
    shards = source.manifest["shards"]
    self._path = os.fspath(source.path)
    self._files = [str(shard[kind]) for shard in shards]
    self._sizes = [int(shard["num_tokens"]) for shard in shards]
    self._dtype = np.dtype(np.uint8) if kind == "mask" else np.dtype(source.dtype)
    counts = np.asarray([int(shard["num_documents"]) for shard in shards], dtype=np.int64)
    self._doc_starts = np.zeros(len(shards) + 1, dtype=np.int64)
    np.cumsum(counts, out=self._doc_starts[1:])
    lengths = np.asarray(source.lengths, dtype=np.int64)
    if lengths.shape[0] != self._doc_starts[-1]:
      raise ArgumentError(f"{self._path}: manifest lists {self._doc_starts[-1]} documents but the "
                       f"source has {lengths.shape[0]} lengths")
    token_start = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=token_start[1:])
    local = token_start[:-1] - np.repeat(token_start[self._doc_starts[:-1]], counts)
    small = local.size == 0 or int(local.max()) < 2**31
    self._local_start = local.astype(np.int32 if small else np.int64)
    self._arrays: list[np.ndarray] | None = None
    vocab = getattr(source, "vocab_size", None) if kind == "tokens" else None
    self._vocab = None if vocab is None else int(vocab)

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    state["_arrays"] = None  # Reopened lazily in every process.
    return state

  def _open(self) -> list[np.ndarray]:
    if self._arrays is None:
      arrays = []
      for name, tokens in zip(self._files, self._sizes):
        file = os.path.join(self._path, name)
        size, want = os.path.getsize(file), tokens * self._dtype.itemsize
        if size != want:  # Changed since `ShardSource` checked it (a worker opens it later).
          raise ShardFormatError(
              f"{file}: file is {size} bytes but the manifest says {tokens} {self._dtype.name} "
              f"values ({want} bytes); it changed after the dataset was opened"
              + (" (truncated)" if size < want else ""))
        if size == 0:
          arrays.append(np.zeros(0, dtype=self._dtype))
        else:
          arrays.append(np.asarray(np.memmap(file, dtype=self._dtype, mode="r")))
      self._arrays = arrays
    return self._arrays

  def copy(self, out: np.ndarray, doc_P: np.ndarray, lo_P: np.ndarray, hi_P: np.ndarray,
           dst_P: np.ndarray) -> None:
    """Copies tokens `[lo, hi)` of every piece's document to `out[dst:]`."""
    arrays = self._open()
    shard_P = np.searchsorted(self._doc_starts, doc_P, side="right") - 1
    base_P = self._local_start[doc_P].astype(np.int64)
    for s, a, b, dst in zip(shard_P.tolist(), (base_P + lo_P).tolist(), (base_P + hi_P).tolist(),
                            dst_P.tolist()):
      if b > a:
        out[dst:dst + b - a] = arrays[s][a:b]
    if self._vocab is not None and len(dst_P) and _unsigned_max(out) >= self._vocab:
      self._refuse_ids(arrays, doc_P, shard_P, base_P + lo_P, base_P + hi_P)

  def _refuse_ids(self, arrays: list[np.ndarray], doc_P: np.ndarray, shard_P: np.ndarray,
                  a_P: np.ndarray, b_P: np.ndarray) -> None:
    """Raises naming the first piece holding a token id >= vocab_size (none: `out` held a
    padding id that large, which is the caller's)."""
    for d, s, a, b in zip(np.asarray(doc_P).tolist(), shard_P.tolist(), a_P.tolist(),
                          b_P.tolist()):
      piece = arrays[s][a:b]
      if b > a and int(piece.max()) >= self._vocab:
        k = int(np.argmax(piece >= self._vocab))
        raise ShardFormatError(
            f"{os.path.join(self._path, self._files[s])}: token id {int(piece[k])} at position "
            f"{a + k} (document {d} of the dataset) is >= vocab_size {self._vocab} of "
            f"{os.path.join(self._path, 'manifest.json')}; the shard or the manifest changed "
            f"after it was written (ShardSource(path).verify() checks every file)")


def _unsigned_max(out: np.ndarray) -> int:
  """The largest value of `out`, negative values read as the large unsigned ids they wrap
  (a uint32 id >= 2**31 copied into int32)."""
  if out.dtype.kind == "i":
    return int(out.view(out.dtype.str.replace("i", "u")).max())
  return int(out.max())


class SubsetReader:
  """Reads the documents of a subset through its parents' readers: document `d` is document
  `parent_ids[d]` of parent `parent_index[d]`."""

  def __init__(self, parent_readers: list[Any], parent_index: np.ndarray, parent_ids: np.ndarray):
    self._parents = parent_readers
    # Kept in their own integer dtypes: a mixture's draw holds int32 ids and a uint8 source.
    self._which = np.asarray(parent_index)
    self._ids = np.asarray(parent_ids)

  def copy(self, out: np.ndarray, doc_P: np.ndarray, lo_P: np.ndarray, hi_P: np.ndarray,
           dst_P: np.ndarray) -> None:
    doc_P = np.asarray(doc_P, dtype=np.int64)
    if len(self._parents) == 1:
      self._parents[0].copy(out, self._ids[doc_P], lo_P, hi_P, dst_P)
      return
    which_P = self._which[doc_P]
    for k, reader in enumerate(self._parents):
      sel = which_P == k
      if sel.any():
        reader.copy(out, self._ids[doc_P[sel]], np.asarray(lo_P)[sel], np.asarray(hi_P)[sel],
                    np.asarray(dst_P)[sel])


class OnesReader:
  """The loss mask of a source without one: every token trained."""

  def copy(self, out: np.ndarray, doc_P: np.ndarray, lo_P: np.ndarray, hi_P: np.ndarray,
           dst_P: np.ndarray) -> None:
    for lo, hi, dst in zip(np.asarray(lo_P).tolist(), np.asarray(hi_P).tolist(),
                           np.asarray(dst_P).tolist()):
      out[dst:dst + max(hi - lo, 0)] = 1


def make_token_reader(source: Any) -> SequenceSliceReader | ShardTokenReader | SubsetReader:
  """A `SubsetReader` for a subset (has `parent`, `parent_ids`), a `ShardTokenReader` for a shard
  source (has `path`, `manifest`, `dtype`, `lengths`), else a `SequenceSliceReader`."""
  if getattr(source, "parent_ids", None) is not None:
    return SubsetReader([make_token_reader(p) for p in source.parents], source.parent_index,
                        source.parent_ids)
  manifest = getattr(source, "manifest", None)
  if (isinstance(manifest, dict) and isinstance(manifest.get("shards"), list)
      and hasattr(source, "path") and hasattr(source, "dtype") and hasattr(source, "lengths")):
    try:
      return ShardTokenReader(source)
    except (KeyError, TypeError):
      pass
  return SequenceSliceReader(source.__getitem__)


def make_mask_reader(source: Any) -> SequenceSliceReader | ShardTokenReader | SubsetReader:
  """The loss-mask counterpart of `make_token_reader` (the source must have `loss_mask(d)`)."""
  if getattr(source, "parent_ids", None) is not None:
    return SubsetReader([make_mask_reader(p) if getattr(p, "has_loss_mask", False)
                         else OnesReader() for p in source.parents],
                        source.parent_index, source.parent_ids)
  manifest = getattr(source, "manifest", None)
  if (isinstance(manifest, dict) and manifest.get("loss_mask") is True
      and hasattr(source, "path") and hasattr(source, "lengths")):
    try:
      return ShardTokenReader(source, kind="mask")
    except (KeyError, TypeError):
      pass
  return SequenceSliceReader(source.loss_mask)

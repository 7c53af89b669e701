"""`ShardSource`: a shard dataset as a Grain random-access source of zero-copy read-only views."""

from __future__ import annotations

import hashlib
import json
import operator
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from segpack import files
from segpack import remote_files
from segpack.errors import ArgumentError, ArgumentTypeError
from segpack.shards import staging
from segpack.shards import verified
from segpack.shards.format import (
    FORMAT_VERSION, HASH_BLOCK, MANIFEST_NAME, OFFSET_DTYPE, ShardFormatError, check_offsets,
    load_manifest, require)
from segpack.shards.record import DatasetRecord

VERIFY_MODES = ("once", "always", "never")


class ShardSource:
  """A Grain random-access data source over every document of a shard dataset.

  Algorithm:
    1. Open: read the manifest and run the cheap structural checks on every shard (file sizes
       against the manifest, offsets start at 0, never decrease, end at the token count, the
       manifest's `max_token` below `vocab_size`). The document lengths are the differences of
       the offsets. Then, unless `verify="never"`, every file is hashed against the manifest's
       SHA-256 (and, for shards without `max_token`, the tokens scanned for ids >= vocab_size);
       with `verify="once"` a success is remembered per machine (`segpack.shards.verified`) and
       later opens skip the files that have not changed since.
    2. `source[i]`: find the shard by binary search over the cumulative document counts, read the
       two offsets around the document and return that slice of the shard's read-only memmap (a
       zero-copy view). Memmaps are opened on first access in each process, under a lock, so the
       source pickles cheaply to Grain workers and is safe to read from several threads.
    3. `verify()`: additionally hash every file against the manifest's SHA-256 and scan for token
       ids >= vocab_size.

  Example: shards with offsets [0, 3, 5] and [0, 1] give len 3, lengths [3, 2, 1], and `source[2]`
  is token 0 of shard 1.
  """

  def __init__(self, path: str | os.PathLike[str], *, verify: str = "once"):
    """Opens the dataset at `path` (a directory with a manifest.json).

    Args:
      path: the dataset directory, or its URL (`gs://`, `s3://`, `hdfs://`): staged first into
        the local cache (`segpack.shards.staging`, needs segpack[beam]) and the copy opened.
      verify: `"once"` (default): hash each shard file on the first open on this machine and
        remember the success until the file changes; `"always"`: hash on every open;
        `"never"`: only the cheap structural checks.

    Raises:
      ShardFormatError: naming the file and the offending value.
    """
    if verify not in VERIFY_MODES:
      raise ArgumentError(f"ShardSource({str(path)!r}): verify must be one of {VERIFY_MODES}, got "
                       f"{verify!r}")
    if remote_files.is_url(path):
      path = staging.stage_dataset(url=os.fspath(path)).path
    # Absolute: a dataset read lazily (Grain's rows, worker processes) does not depend on the
    # current directory staying what it was when the dataset was opened.
    self.path = Path(os.path.abspath(path))
    self.manifest = load_manifest(self.path)
    # What the dataset's metadata says (tokenizer, chat template); a wrong-typed field is refused.
    self.record = DatasetRecord.from_manifest(self.manifest, where=self.path / MANIFEST_NAME)
    self.vocab_size: int = self.manifest["vocab_size"]
    self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
    self.tokenizer_fingerprint: str = self.manifest["tokenizer_fingerprint"]
    self.num_tokens: int = self.manifest["num_tokens"]
    shards = self.manifest["shards"]
    self.num_shards = len(shards)
    self.has_loss_mask: bool = bool(self.manifest.get("loss_mask", False))
    self._doc_starts = np.zeros(len(shards) + 1, dtype=np.int64)
    np.cumsum([s["num_documents"] for s in shards], out=self._doc_starts[1:])
    self.fingerprint = hashlib.sha256(json.dumps({
        "format_version": FORMAT_VERSION,
        "dtype": self.manifest["dtype"],
        "vocab_size": self.vocab_size,
        "tokenizer_fingerprint": self.tokenizer_fingerprint,
        "shards": [[s["num_documents"], s["num_tokens"], s["sha256"]["tokens"],
                    s["sha256"]["offsets"]] + ([s["sha256"]["mask"]] if self.has_loss_mask else [])
                   for s in shards],
    }, sort_keys=True).encode("utf-8")).hexdigest()
    self._lock = threading.Lock()
    self._tokens: list[np.ndarray] | None = None
    self._offsets: list[np.ndarray] | None = None
    self._masks: list[np.ndarray] | None = None
    self._lengths = self._structural_check()
    if verify != "never":
      self._check_files(verified.VerifiedCache() if verify == "once" else None)

  def _structural_check(self) -> np.ndarray:
    lengths = []
    for shard in self.manifest["shards"]:
      tokens_path = self.path / shard["tokens"]
      offsets_path = self.path / shard["offsets"]
      for p in (tokens_path, offsets_path):
        require(p.is_file(), p, "shard file listed in the manifest is missing")
      size = tokens_path.stat().st_size
      want = shard["num_tokens"] * self.dtype.itemsize
      require(size == want, tokens_path,
               f"token file is {size} bytes but the manifest says {shard['num_tokens']} "
               f"{self.dtype.name} tokens ({want} bytes)" + (" (truncated)" if size < want else ""))
      top = shard.get("max_token")
      require(top is None or top < self.vocab_size, tokens_path,
               f"largest token id {top} (manifest max_token) is >= vocab_size {self.vocab_size}")
      if self.has_loss_mask:
        mask_path = self.path / shard["mask"]
        require(mask_path.is_file(), mask_path, "mask file listed in the manifest is missing")
        size = mask_path.stat().st_size
        require(size == shard["num_tokens"], mask_path,
                 f"mask file is {size} bytes but the manifest says {shard['num_tokens']} tokens "
                 f"(one uint8 per token)")
      size = offsets_path.stat().st_size
      want = (shard["num_documents"] + 1) * OFFSET_DTYPE.itemsize
      require(size == want, offsets_path,
               f"offsets file is {size} bytes but the manifest says {shard['num_documents']} "
               f"documents ({want} bytes)")
      offsets = np.fromfile(offsets_path, dtype=OFFSET_DTYPE)
      check_offsets(offsets, offsets_path, shard["num_tokens"])
      lengths.append(np.diff(offsets))
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)

  # Pickling: only the small state travels; memmaps and lengths are rebuilt on first use.
  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    for key in ("_lock", "_tokens", "_offsets", "_lengths", "_masks"):
      state.pop(key)
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._lock = threading.Lock()
    self._tokens = self._offsets = self._masks = None
    self._lengths = None

  def _open(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
    tokens, offsets = self._tokens, self._offsets
    if tokens is not None and offsets is not None:
      return tokens, offsets
    with self._lock:
      if self._tokens is None or self._offsets is None:
        toks, offs = [], []
        for shard in self.manifest["shards"]:
          p = self.path / shard["tokens"]
          require(p.stat().st_size == shard["num_tokens"] * self.dtype.itemsize, p,
                   "token file changed size since the dataset was opened")
          toks.append(np.memmap(p, dtype=self.dtype, mode="r") if shard["num_tokens"]
                      else np.zeros(0, dtype=self.dtype))  # An empty file cannot be mapped.
          p = self.path / shard["offsets"]
          require(p.stat().st_size == (shard["num_documents"] + 1) * OFFSET_DTYPE.itemsize, p,
                   "offsets file changed size since the dataset was opened")
          offs.append(np.memmap(p, dtype=OFFSET_DTYPE, mode="r"))
        self._offsets = offs
        self._tokens = toks
      return self._tokens, self._offsets

  def _open_masks(self) -> list[np.ndarray]:
    masks = self._masks
    if masks is not None:
      return masks
    if not self.has_loss_mask:
      raise ShardFormatError(f"{self.path}: this dataset has no loss mask (manifest loss_mask is "
                             f"not true)")
    with self._lock:
      if self._masks is None:
        self._masks = [
            np.memmap(self.path / shard["mask"], dtype=np.uint8, mode="r") if shard["num_tokens"]
            else np.zeros(0, dtype=np.uint8) for shard in self.manifest["shards"]]
      return self._masks

  def _locate(self, index: Any) -> tuple[int, int, int]:
    """(shard, start, stop) of document `index` inside its shard's token file."""
    try:
      i = operator.index(index)
    except TypeError:
      raise ArgumentTypeError(
          f"ShardSource({str(self.path)!r}): index must be an integer, got {index!r}") from None
    n = len(self)
    if i < 0:
      i += n
    if not 0 <= i < n:
      raise IndexError(f"ShardSource({str(self.path)!r}): index {index} out of range for {n} "
                       f"documents")
    _, offsets = self._open()
    shard = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
    local = i - int(self._doc_starts[shard])
    return shard, int(offsets[shard][local]), int(offsets[shard][local + 1])

  def loss_mask(self, index: Any) -> np.ndarray:
    """The uint8 loss mask of document `index` (1 = trained), a read-only view aligned with
    `self[index]`; raises ShardFormatError when the dataset has no mask (`has_loss_mask`)."""
    masks = self._open_masks()
    shard, start, stop = self._locate(index)
    return np.asarray(masks[shard][start:stop])

  @property
  def lengths(self) -> np.ndarray:
    """int64 [len(self)]: every document's token count (from the offsets files alone)."""
    if self._lengths is None:
      with self._lock:
        if self._lengths is None:
          self._lengths = self._structural_check()
    return self._lengths

  def __len__(self) -> int:
    return int(self._doc_starts[-1])

  def __getitem__(self, index: Any) -> np.ndarray:
    """Document `index` (int or NumPy integer; negative counts from the end), a read-only view."""
    shard, start, stop = self._locate(index)
    tokens, _ = self._open()
    return np.asarray(tokens[shard][start:stop])

  def __iter__(self):
    for i in range(len(self)):
      yield self[i]

  def __repr__(self) -> str:
    return (f"ShardSource({str(self.path)!r}, documents={len(self)}, tokens={self.num_tokens}, "
            f"fingerprint={self.fingerprint[:16]})")

  def verify(self) -> None:
    """Full check: every file's SHA-256 against the manifest and every token id < vocab_size.

    Raises:
      ShardFormatError: naming the file and the mismatch or the offending token (its position,
        document and value).
    """
    self._check_files(None, scan=True)

  def _check_files(self, cache: verified.VerifiedCache | None, *, scan: bool = False) -> None:
    """Hashes every file (skipping those `cache` knows unchanged) and checks the token ids.

    Token ids are scanned when `scan` or the shard has no `max_token`; the largest id found is
    remembered with the token file's entry, so a later edit of `vocab_size` is still caught.
    """
    kinds = ("tokens", "offsets") + (("mask",) if self.has_loss_mask else ())
    updates = {}
    for s, shard in enumerate(self.manifest["shards"]):
      for kind in kinds:
        p = self.path / shard[kind]
        expected = shard["sha256"][kind]
        entry = cache.lookup(p, expected) if cache is not None else None
        need_max = kind == "tokens" and (scan or shard.get("max_token") is None)
        if entry is None or (need_max and entry.get("max_token") is None and shard["num_tokens"]):
          key = verified.file_key(p)
          digest = files.sha256_file(p)
          require(digest == expected, p,
                   f"checksum mismatch: sha256 {digest} but the manifest says {expected}")
          entry = {"sha256": expected, "key": key}
          if need_max:
            entry["max_token"] = self._scan_tokens(s)
          if kind == "mask":
            self._verify_mask(s)
          if cache is not None and verified.file_key(p) == key:  # unchanged while hashed
            updates[verified.entry_name(p)] = entry
        top = entry.get("max_token")
        require(kind != "tokens" or top is None or top < self.vocab_size, p,
                 f"largest token id {top} (found when the file was verified) is >= vocab_size "
                 f"{self.vocab_size}")
    if cache is not None:
      cache.record(updates)

  def _scan_tokens(self, s: int) -> int | None:
    """The largest token id of shard `s` (None when empty); raises at the first id too large."""
    tokens, offsets = self._open()
    mm, shard = tokens[s], self.manifest["shards"][s]
    top = None
    for lo in range(0, mm.size, HASH_BLOCK):
      block = mm[lo:lo + HASH_BLOCK]
      block_max = int(block.max())
      if block_max >= self.vocab_size:
        pos = lo + int(np.argmax(block >= self.vocab_size))
        local = int(np.searchsorted(offsets[s], pos, side="right")) - 1
        raise ShardFormatError(
            f"{self.path / shard['tokens']}: token id {int(mm[pos])} at position {pos} "
            f"(document {int(self._doc_starts[s]) + local}) is >= vocab_size {self.vocab_size}")
      top = block_max if top is None else max(top, block_max)
    return top

  def _verify_mask(self, s: int) -> None:
    """Every mask byte of shard `s` is 0 or 1."""
    mm = self._open_masks()[s]
    for lo in range(0, mm.size, HASH_BLOCK):
      block = mm[lo:lo + HASH_BLOCK]
      if int(block.max()) > 1:
        pos = lo + int(np.argmax(block > 1))
        raise ShardFormatError(
            f"{self.path / self.manifest['shards'][s]['mask']}: loss mask value {int(mm[pos])} at "
            f"position {pos} is not 0 or 1")

"""Memory-mapped token shards: the on-disk format of tokenized documents (see docs/format.md).

A dataset is a directory holding shards and one manifest:

    manifest.json           written last, atomically: the dataset exists once this file does
    shard-00000.tokens      token ids of the shard's documents, back to back (little-endian
                            uint16 when the vocabulary fits, else uint32)
    shard-00000.offsets     int64 little-endian, documents + 1 entries: 0, end of doc 0, ...
    shard-00000.mask        optional (`loss_mask=True`): uint8, one per token, 1 = trained
    shard-00000.done.json   while a dataset is being written: the record of a finished shard,
                            which lets an interrupted writer resume (removed once the manifest
                            is written)

`ShardWriter` streams documents into shards; `ShardSource` reads them back as a Grain
random-access data source of zero-copy read-only views.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import re
import secrets
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ShardFormatError",
    "ShardSource",
    "ShardWriter",
    "atomic_write_bytes",
    "atomic_write_json",
    "dtype_for_vocab",
]

FORMAT_NAME = "segpack-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_OFFSET_DTYPE = np.dtype("<i8")
# Every file the writer may own in a dataset directory (finished or temporary).
_OWNED_FILE = re.compile(
    r"^(shard-\d{5,}\.(tokens|offsets|mask|done\.json)|manifest\.json)(\..*\.tmp)?$")
_HASH_BLOCK = 1 << 24


class ShardFormatError(ValueError):
  """A dataset directory, manifest or shard file is missing, malformed or inconsistent."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
  """The token dtype of a vocabulary: little-endian uint16 when ids fit, else uint32."""
  if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool):
    raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
  if not 1 <= vocab_size <= 2**32:
    raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
  return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _shard_names(index: int) -> tuple[str, str, str]:
  stem = f"shard-{index:05d}"
  return f"{stem}.tokens", f"{stem}.offsets", f"{stem}.done.json"


def _mask_name(index: int) -> str:
  return f"shard-{index:05d}.mask"


def _fsync_dir(path: Path) -> None:
  """Makes a rename in `path` durable (best effort: some filesystems refuse directory fsync)."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
  """Writes `data` to `path` through a temporary file in the same directory and a rename."""
  # Not tempfile.mkstemp: its files are mode 0600, these should follow the umask like any other.
  tmp = path.parent / f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
  try:
    with open(tmp, "xb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def atomic_write_json(path: Path, obj: Any) -> None:
  """Writes `obj` as indented, key-sorted JSON to `path`, atomically."""
  atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def _sha256_file(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(_HASH_BLOCK):
      digest.update(block)
  return digest.hexdigest()


class ShardWriter:
  """Streams documents into the shards of a new dataset directory; a context manager.

  Algorithm:
    1. Open: remove the files of any earlier dataset in the directory (only names the format owns),
       unless `resume_key` is given, in which case the finished shards of an interrupted run with
       the same key are kept (checked against their done-records and checksums) and the rest is
       removed; `resumed_inputs` then tells the caller how many input documents they consumed.
    2. `write(doc)`: an empty document is counted and skipped; otherwise its tokens are appended to
       the current shard's temporary token file and its end to the shard's offsets. Once the shard
       holds `shard_tokens` tokens or more it is finished: both files are renamed to their final
       names, then a done-record (counts, checksums, the range of input documents) is written.
       A document is never split across shards, so a shard may exceed `shard_tokens` by one
       document.
    3. Close: finish the last shard, write the manifest atomically, remove the done-records. An
       exception inside the `with` block removes the temporary shard and writes no manifest.

  Example: with `shard_tokens=4`, writing [5, 6, 7], [], [8, 9], [1] gives shard 0 = tokens
  [5, 6, 7, 8, 9] offsets [0, 3, 5] and shard 1 = tokens [1] offsets [0, 1]; one empty document
  skipped; `inputs` 4.

  With `loss_mask=True` every `write` also takes a per-token mask (1 = the token is trained as a
  target, 0 = not), streamed to `shard-NNNNN.mask` (uint8) beside the token file: writing
  [5, 6, 7] with mask [0, 1, 1] adds the bytes 00 01 01.
  """

  def __init__(
      self,
      path: str | os.PathLike[str],
      *,
      vocab_size: int,
      tokenizer_fingerprint: str,
      shard_tokens: int = 1 << 27,
      metadata: Mapping[str, Any] | None = None,
      resume_key: str | None = None,
      loss_mask: bool = False,
  ):
    """Opens a dataset directory for writing.

    Args:
      path: dataset directory, created when missing.
      vocab_size: tokens must lie in [0, vocab_size); also picks the dtype (`dtype_for_vocab`).
      tokenizer_fingerprint: identifies the tokenizer (e.g. the SHA-256 of its model file).
      shard_tokens: a shard is finished once it holds this many tokens (default 2**27).
      metadata: JSON-serialisable extra information stored in the manifest.
      resume_key: when given, keep the finished shards of an interrupted writer with the same key
        (see `resumed_inputs`); when None, start from scratch.
      loss_mask: every document comes with a per-token loss mask (`write(doc, loss_mask=...)`),
        stored in `shard-NNNNN.mask` files.
    """
    if not isinstance(shard_tokens, (int, np.integer)) or shard_tokens < 1:
      raise ValueError(f"ShardWriter: shard_tokens must be a positive int, got {shard_tokens!r}")
    if not isinstance(tokenizer_fingerprint, str):
      raise TypeError(
          f"ShardWriter: tokenizer_fingerprint must be a str, got {tokenizer_fingerprint!r}")
    self.path = Path(path)
    self.vocab_size = int(vocab_size)
    self.dtype = dtype_for_vocab(vocab_size)
    self.tokenizer_fingerprint = tokenizer_fingerprint
    self.shard_tokens = int(shard_tokens)
    self.metadata = dict(metadata or {})
    json.dumps(self.metadata)  # Fails early when not serialisable.
    self.resume_key = resume_key
    self.loss_mask = bool(loss_mask)
    self._open_mask: tuple[Any, Path] | None = None
    self._mask_hash = hashlib.sha256()
    self.path.mkdir(parents=True, exist_ok=True)
    self._records: list[dict[str, Any]] = []
    self.inputs = 0
    self.skipped_empty = 0
    self._closed = False
    self._open_shard: tuple[Any, Path] | None = None
    self._offsets: list[int] = [0]
    self._hash = hashlib.sha256()
    self._shard_input_start = 0
    self._shard_skipped = 0
    self._prepare_directory()
    self.resumed_inputs = self.inputs
    self.resumed_shards = len(self._records)

  # ---------------------------------------------------------------------------------------------
  # Opening and resuming.

  def _prepare_directory(self) -> None:
    (self.path / MANIFEST_NAME).unlink(missing_ok=True)
    if self.resume_key is not None:
      self._records = self._kept_records()
    kept = set()
    for record in self._records:
      kept.update((record["tokens"], record["offsets"], _shard_names(record["index"])[2]))
      if record.get("mask"):
        kept.add(record["mask"])
    for entry in os.listdir(self.path):
      if _OWNED_FILE.match(entry) and entry not in kept:
        (self.path / entry).unlink()
    if self._records:
      last = self._records[-1]
      self.inputs = last["input_end"]
      self.skipped_empty = sum(r["skipped_empty"] for r in self._records)

  def _kept_records(self) -> list[dict[str, Any]]:
    """The consecutive finished shards, from 0, that an interrupted run with our key left."""
    records = []
    while True:
      tokens_name, offsets_name, done_name = _shard_names(len(records))
      try:
        record = json.loads((self.path / done_name).read_text("utf-8"))
      except (OSError, ValueError):
        return records
      if (record.get("resume_key") != self.resume_key or record.get("dtype") != self.dtype.name
          or record.get("index") != len(records) or record.get("tokens") != tokens_name
          or record.get("offsets") != offsets_name
          or record.get("mask") != (_mask_name(len(records)) if self.loss_mask else None)):
        return records
      try:
        ok = (_sha256_file(self.path / tokens_name) == record["sha256"]["tokens"]
              and _sha256_file(self.path / offsets_name) == record["sha256"]["offsets"]
              and (not self.loss_mask
                   or _sha256_file(self.path / record["mask"]) == record["sha256"]["mask"]))
      except (OSError, KeyError, TypeError):
        ok = False
      if not ok:
        return records
      records.append(record)

  # ---------------------------------------------------------------------------------------------
  # Writing.

  def __enter__(self) -> ShardWriter:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
    else:
      self.abort()

  def write(self, doc_tokens: Any, loss_mask: Any = None) -> None:
    """Appends one document (a 1-D array of integer token ids); empty documents are skipped.

    Args:
      doc_tokens: the token ids.
      loss_mask: required exactly when the writer was opened with `loss_mask=True`: one 0/1 value
        per token (1: the token is trained as a target).
    """
    if self._closed:
      raise ValueError(f"ShardWriter({str(self.path)!r}): write() after close()")
    mask = self._check_mask(doc_tokens, loss_mask)
    doc = np.asarray(doc_tokens)
    if doc.ndim != 1 or not (doc.dtype.kind in "iu" or doc.size == 0):
      raise TypeError(
          f"ShardWriter({str(self.path)!r}): document {self.inputs} must be a 1-D integer array, "
          f"got dtype {doc.dtype} shape {doc.shape}")
    self.inputs += 1
    if doc.size == 0:
      self.skipped_empty += 1
      self._shard_skipped += 1
      return
    lo, hi = int(doc.min()), int(doc.max())
    if lo < 0 or hi >= self.vocab_size:
      self.inputs -= 1
      raise ValueError(
          f"ShardWriter({str(self.path)!r}): document {self.inputs} has token id "
          f"{lo if lo < 0 else hi} outside [0, vocab_size={self.vocab_size})")
    if self._open_shard is None:
      tokens_name = _shard_names(len(self._records))[0]
      tmp = self.path / f"{tokens_name}.writing.tmp"
      self._open_shard = (open(tmp, "wb"), tmp)
    data = doc.astype(self.dtype, copy=False).tobytes()
    self._open_shard[0].write(data)
    self._hash.update(data)
    if mask is not None:
      if self._open_mask is None:
        tmp = self.path / f"{_mask_name(len(self._records))}.writing.tmp"
        self._open_mask = (open(tmp, "wb"), tmp)
      mask_bytes = mask.tobytes()
      self._open_mask[0].write(mask_bytes)
      self._mask_hash.update(mask_bytes)
    self._offsets.append(self._offsets[-1] + doc.size)
    if self._offsets[-1] >= self.shard_tokens:
      self._finish_shard()

  def _check_mask(self, doc_tokens: Any, loss_mask: Any) -> np.ndarray | None:
    """The mask as uint8 (None without `loss_mask`); raises when it does not fit the writer."""
    where = f"ShardWriter({str(self.path)!r}): document {self.inputs}"
    if not self.loss_mask:
      if loss_mask is not None:
        raise ValueError(f"{where}: got a loss_mask but the writer was opened with "
                         f"loss_mask=False")
      return None
    if loss_mask is None:
      raise ValueError(f"{where}: the writer was opened with loss_mask=True; pass loss_mask=...")
    mask = np.asarray(loss_mask)
    size = np.shape(doc_tokens)
    if mask.shape != size:
      raise ValueError(f"{where}: loss_mask has shape {mask.shape}, the tokens {size}")
    if mask.size and not np.isin(mask, (0, 1)).all():
      bad = mask.reshape(-1)[~np.isin(mask.reshape(-1), (0, 1))][0].item()
      raise ValueError(f"{where}: loss_mask values must be 0 or 1, got {bad!r}")
    return mask.astype(np.uint8)

  def _finish_shard(self) -> None:
    assert self._open_shard is not None
    f, tmp = self._open_shard
    f.flush()
    os.fsync(f.fileno())
    f.close()
    self._open_shard = None
    index = len(self._records)
    tokens_name, offsets_name, done_name = _shard_names(index)
    offsets = np.asarray(self._offsets, dtype=_OFFSET_DTYPE).tobytes()
    atomic_write_bytes(self.path / offsets_name, offsets)
    mask_name = None
    if self.loss_mask:
      assert self._open_mask is not None
      mf, mtmp = self._open_mask
      mf.flush()
      os.fsync(mf.fileno())
      mf.close()
      self._open_mask = None
      mask_name = _mask_name(index)
      os.replace(mtmp, self.path / mask_name)
    os.replace(tmp, self.path / tokens_name)
    record = {
        "index": index,
        "tokens": tokens_name,
        "offsets": offsets_name,
        "num_documents": len(self._offsets) - 1,
        "num_tokens": self._offsets[-1],
        "sha256": {"tokens": self._hash.hexdigest(),
                   "offsets": hashlib.sha256(offsets).hexdigest()},
        "mask": mask_name,
        "dtype": self.dtype.name,
        "resume_key": self.resume_key,
        "input_start": self._shard_input_start,
        "input_end": self.inputs,
        "skipped_empty": self._shard_skipped,
    }
    if mask_name is not None:
      record["sha256"]["mask"] = self._mask_hash.hexdigest()
    atomic_write_json(self.path / done_name, record)
    self._records.append(record)
    self._offsets = [0]
    self._hash = hashlib.sha256()
    self._mask_hash = hashlib.sha256()
    self._shard_input_start = self.inputs
    self._shard_skipped = 0

  def abort(self) -> None:
    """Drops the unfinished shard and writes no manifest; finished shards stay for a resume."""
    for attr in ("_open_shard", "_open_mask"):
      if getattr(self, attr) is not None:
        f, tmp = getattr(self, attr)
        f.close()
        tmp.unlink(missing_ok=True)
        setattr(self, attr, None)
    self._closed = True

  def close(self) -> dict[str, Any]:
    """Finishes the last shard and writes the manifest; returns the manifest."""
    if self._closed:
      raise ValueError(f"ShardWriter({str(self.path)!r}): close() called twice")
    if self._open_shard is not None:
      self._finish_shard()
    self._closed = True
    keys = ("tokens", "offsets", "num_documents", "num_tokens", "sha256") + (
        ("mask",) if self.loss_mask else ())
    shards = [{k: r[k] for k in keys} for r in self._records]
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dtype": self.dtype.name,
        "byte_order": "little",
        "vocab_size": self.vocab_size,
        "tokenizer_fingerprint": self.tokenizer_fingerprint,
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "skipped_empty": self.skipped_empty,
        "inputs": self.inputs,
        "resume_key": self.resume_key,
        "metadata": self.metadata,
        "shards": shards,
    }
    if self.loss_mask:
      manifest["loss_mask"] = True
    atomic_write_json(self.path / MANIFEST_NAME, manifest)
    for record in self._records:
      (self.path / _shard_names(record["index"])[2]).unlink(missing_ok=True)
    return manifest


# -----------------------------------------------------------------------------------------------
# Reading.


def _require(cond: bool, path: Path, message: str) -> None:
  if not cond:
    raise ShardFormatError(f"{path}: {message}")


def _load_manifest(root: Path) -> dict[str, Any]:
  """Reads and checks the manifest's fields and types (not the shard files)."""
  if not root.exists():
    raise ShardFormatError(f"{root}: dataset directory does not exist")
  if not root.is_dir():
    raise ShardFormatError(f"{root}: not a directory")
  path = root / MANIFEST_NAME
  if not path.exists():
    unfinished = sorted(p.name for p in root.iterdir() if _OWNED_FILE.match(p.name))
    hint = (f" (it holds {len(unfinished)} shard files of an unfinished write; rerun the "
            f"tokenizer to complete it)" if unfinished else "")
    raise ShardFormatError(f"{path}: missing manifest{hint}")
  try:
    manifest = json.loads(path.read_text("utf-8"))
  except UnicodeDecodeError as e:
    raise ShardFormatError(f"{path}: corrupt manifest, not UTF-8 ({e})") from e
  except json.JSONDecodeError as e:
    raise ShardFormatError(
        f"{path}: corrupt manifest, invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
    ) from e
  _require(isinstance(manifest, dict), path, f"corrupt manifest, expected an object, got "
           f"{type(manifest).__name__}")
  _require(manifest.get("format") == FORMAT_NAME, path,
           f"format is {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
  _require(manifest.get("format_version") == FORMAT_VERSION, path,
           f"unsupported format_version {manifest.get('format_version')!r} (this reader: "
           f"{FORMAT_VERSION})")
  vocab = manifest.get("vocab_size")
  _require(isinstance(vocab, int) and not isinstance(vocab, bool) and 1 <= vocab <= 2**32, path,
           f"vocab_size must be an int in [1, 2**32], got {vocab!r}")
  _require(manifest.get("dtype") == dtype_for_vocab(vocab).name, path,
           f"dtype {manifest.get('dtype')!r} does not match vocab_size {vocab} (expected "
           f"{dtype_for_vocab(vocab).name!r})")
  _require(isinstance(manifest.get("tokenizer_fingerprint"), str), path,
           f"tokenizer_fingerprint must be a string, got "
           f"{manifest.get('tokenizer_fingerprint')!r}")
  shards = manifest.get("shards")
  _require(isinstance(shards, list), path, f"shards must be a list, got {shards!r:.80}")
  for i, shard in enumerate(shards):
    ok = (isinstance(shard, dict)
          and all(isinstance(shard.get(k), str) and "/" not in shard[k]
                  and shard[k] not in ("", ".", "..") for k in ("tokens", "offsets"))
          and all(isinstance(shard.get(k), int) and shard[k] >= 0
                  for k in ("num_documents", "num_tokens"))
          and isinstance(shard.get("sha256"), dict)
          and all(isinstance(shard["sha256"].get(k), str) for k in ("tokens", "offsets")))
    _require(ok, path, f"shards[{i}] is malformed: {shard!r:.200}")
  has_mask = manifest.get("loss_mask", False)
  _require(isinstance(has_mask, bool), path, f"loss_mask must be true or false, got {has_mask!r}")
  for i, shard in enumerate(shards if has_mask else ()):
    name = shard.get("mask")
    _require(isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
             and isinstance(shard["sha256"].get("mask"), str), path,
             f"loss_mask is true but shards[{i}] has no valid mask file and sha256: {shard!r:.200}")
  for key in ("num_documents", "num_tokens"):
    total = sum(s[key] for s in shards)
    _require(manifest.get(key) == total, path,
             f"{key} is {manifest.get(key)!r} but the shards sum to {total}")
  return manifest


def _check_offsets(offsets: np.ndarray, path: Path, num_tokens: int) -> None:
  """Offsets start at 0, never decrease and end at the token count."""
  _require(int(offsets[0]) == 0, path, f"first offset is {int(offsets[0])}, expected 0")
  steps = np.diff(offsets)
  if steps.size and int(steps.min()) < 0:
    j = int(np.argmax(steps < 0))
    raise ShardFormatError(
        f"{path}: offsets decrease at document {j}: offsets[{j}]={int(offsets[j])} > "
        f"offsets[{j + 1}]={int(offsets[j + 1])}")
  if offsets.size > 1 and int(offsets.max()) > num_tokens:
    j = int(np.argmax(offsets > num_tokens))
    raise ShardFormatError(
        f"{path}: offsets[{j}]={int(offsets[j])} points past the end of the token file "
        f"({num_tokens} tokens)")
  _require(int(offsets[-1]) == num_tokens, path,
           f"last offset is {int(offsets[-1])} but the shard holds {num_tokens} tokens")


class ShardSource:
  """A Grain random-access data source over every document of a shard dataset.

  Algorithm:
    1. Open: read the manifest and run the cheap structural checks on every shard (file sizes
       against the manifest, offsets start at 0, never decrease, end at the token count). The
       document lengths are the differences of the offsets; the token files are not read.
    2. `source[i]`: find the shard by binary search over the cumulative document counts, read the
       two offsets around the document and return that slice of the shard's read-only memmap (a
       zero-copy view). Memmaps are opened on first access in each process, under a lock, so the
       source pickles cheaply to Grain workers and is safe to read from several threads.
    3. `verify()`: additionally hash every file against the manifest's SHA-256 and scan for token
       ids >= vocab_size.

  Example: shards with offsets [0, 3, 5] and [0, 1] give len 3, lengths [3, 2, 1], and `source[2]`
  is token 0 of shard 1.
  """

  def __init__(self, path: str | os.PathLike[str]):
    """Opens the dataset at `path` (a directory with a manifest.json); raises ShardFormatError."""
    self.path = Path(path)
    self.manifest = _load_manifest(self.path)
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

  def _structural_check(self) -> np.ndarray:
    lengths = []
    for shard in self.manifest["shards"]:
      tokens_path = self.path / shard["tokens"]
      offsets_path = self.path / shard["offsets"]
      for p in (tokens_path, offsets_path):
        _require(p.is_file(), p, "shard file listed in the manifest is missing")
      size = tokens_path.stat().st_size
      want = shard["num_tokens"] * self.dtype.itemsize
      _require(size == want, tokens_path,
               f"token file is {size} bytes but the manifest says {shard['num_tokens']} "
               f"{self.dtype.name} tokens ({want} bytes)" + (" (truncated)" if size < want else ""))
      if self.has_loss_mask:
        mask_path = self.path / shard["mask"]
        _require(mask_path.is_file(), mask_path, "mask file listed in the manifest is missing")
        size = mask_path.stat().st_size
        _require(size == shard["num_tokens"], mask_path,
                 f"mask file is {size} bytes but the manifest says {shard['num_tokens']} tokens "
                 f"(one uint8 per token)")
      size = offsets_path.stat().st_size
      want = (shard["num_documents"] + 1) * _OFFSET_DTYPE.itemsize
      _require(size == want, offsets_path,
               f"offsets file is {size} bytes but the manifest says {shard['num_documents']} "
               f"documents ({want} bytes)")
      offsets = np.fromfile(offsets_path, dtype=_OFFSET_DTYPE)
      _check_offsets(offsets, offsets_path, shard["num_tokens"])
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
          _require(p.stat().st_size == shard["num_tokens"] * self.dtype.itemsize, p,
                   "token file changed size since the dataset was opened")
          toks.append(np.memmap(p, dtype=self.dtype, mode="r") if shard["num_tokens"]
                      else np.zeros(0, dtype=self.dtype))  # An empty file cannot be mapped.
          offs.append(np.memmap(self.path / shard["offsets"], dtype=_OFFSET_DTYPE, mode="r"))
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
      raise TypeError(
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
    tokens, offsets = self._open()
    kinds = ("tokens", "offsets") + (("mask",) if self.has_loss_mask else ())
    for s, shard in enumerate(self.manifest["shards"]):
      for kind in kinds:
        p = self.path / shard[kind]
        digest = _sha256_file(p)
        _require(digest == shard["sha256"][kind], p,
                 f"checksum mismatch: sha256 {digest} but the manifest says "
                 f"{shard['sha256'][kind]}")
      mm = tokens[s]
      for lo in range(0, mm.size, _HASH_BLOCK):
        block = mm[lo:lo + _HASH_BLOCK]
        if int(block.max()) >= self.vocab_size:
          pos = lo + int(np.argmax(block >= self.vocab_size))
          local = int(np.searchsorted(offsets[s], pos, side="right")) - 1
          raise ShardFormatError(
              f"{self.path / shard['tokens']}: token id {int(mm[pos])} at position {pos} "
              f"(document {int(self._doc_starts[s]) + local}) is >= vocab_size {self.vocab_size}")
      if self.has_loss_mask:
        self._verify_mask(s)

  def _verify_mask(self, s: int) -> None:
    """Every mask byte of shard `s` is 0 or 1."""
    mm = self._open_masks()[s]
    for lo in range(0, mm.size, _HASH_BLOCK):
      block = mm[lo:lo + _HASH_BLOCK]
      if int(block.max()) > 1:
        pos = lo + int(np.argmax(block > 1))
        raise ShardFormatError(
            f"{self.path / self.manifest['shards'][s]['mask']}: loss mask value {int(mm[pos])} at "
            f"position {pos} is not 0 or 1")

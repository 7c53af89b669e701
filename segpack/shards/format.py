"""The shard format: names, the manifest and its checks (see docs/format.md).

A dataset is a directory holding shards and one manifest:

    manifest.json           written last, atomically: the dataset exists once this file does
    shard-00000.tokens      token ids of the shard's documents, back to back (little-endian
                            uint16 when the vocabulary fits, else uint32)
    shard-00000.offsets     int64 little-endian, documents + 1 entries: 0, end of doc 0, ...
    shard-00000.mask        optional (`loss_mask=True`): uint8, one per token, 1 = trained
    shard-00000.done.json   while a dataset is being written: the record of a finished shard,
                            which lets an interrupted writer resume (removed once the manifest
                            is written)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

from segpack.errors import ArgumentError, ArgumentTypeError, UserError

FORMAT_NAME = "segpack-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
OFFSET_DTYPE = np.dtype("<i8")
# Every file a writer may own in a dataset directory (finished or temporary): the local writer's
# shard-NNNNN.* and the Beam pipeline's shard-FFFFF-BBBBB[-SSSSS].* (segpack/text/beam/pipeline.py).
OWNED_FILE = re.compile(
    r"^(shard-\d{5,}(-\d{5,}){0,2}\.(tokens|offsets|mask|done\.json)|manifest\.json)(\..*\.tmp)?$")
HASH_BLOCK = 1 << 24
# A manifest holds a few hundred bytes per shard: 64 MiB is some 100,000 shards. Larger files are
# refused unread (a manifest that is a link to /dev/zero or a huge file must not fill memory).
MAX_MANIFEST_BYTES = 64 << 20


class ShardFormatError(UserError, ValueError):
  """A dataset directory, manifest or shard file is missing, malformed or inconsistent."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
  """The token dtype of a vocabulary: little-endian uint16 when ids fit, else uint32."""
  if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool):
    raise ArgumentTypeError(f"vocab_size must be an int, got {vocab_size!r}")
  if not 1 <= vocab_size <= 2**32:
    raise ArgumentError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
  return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_names(index: int) -> tuple[str, str, str]:
  stem = f"shard-{index:05d}"
  return f"{stem}.tokens", f"{stem}.offsets", f"{stem}.done.json"


def mask_name(index: int) -> str:
  return f"shard-{index:05d}.mask"


def require(cond: bool, path: Path, message: str) -> None:
  if not cond:
    raise ShardFormatError(f"{path}: {message}")


def metadata_sha256(metadata: Any) -> str:
  """The manifest's `metadata_sha256`: SHA-256 of `metadata` as compact, key-sorted JSON.

  The metadata carries what the packing pipeline reads besides the shards (the tokenizer's
  BOS/EOS ids, the chat template), which no other check covers: a damaged digit there would
  change every row silently.
  """
  text = json.dumps(metadata, sort_keys=True, separators=(",", ":"))
  return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_manifest(path: Path) -> Any:
  """The parsed JSON of the manifest file `path`, read only when it is a regular file of at most
  `MAX_MANIFEST_BYTES`.

  Raises:
    ShardFormatError: naming `path` and why it is unreadable (missing, not a regular file, over
      the bound, an I/O error, not UTF-8, not JSON).
  """
  bound = f"{MAX_MANIFEST_BYTES >> 20} MiB"
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO must not hang the open.
  except OSError as e:
    raise ShardFormatError(f"{path}: unreadable manifest ({e.strerror or e})") from e
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode):
    os.close(fd)
    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, pipe or socket"
    raise ShardFormatError(f"{path}: unreadable manifest, not a regular file ({kind}); a "
                           f"manifest is a JSON file of at most {bound}")
  with os.fdopen(fd, "rb") as f:
    try:
      data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
      raise ShardFormatError(f"{path}: unreadable manifest ({e.strerror or e})") from e
  if len(data) > MAX_MANIFEST_BYTES:
    raise ShardFormatError(f"{path}: manifest is larger than the {bound} bound "
                           f"({st.st_size:,} bytes); refusing to read it")
  try:
    return json.loads(data.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise ShardFormatError(f"{path}: corrupt manifest, not UTF-8 ({e})") from e
  except json.JSONDecodeError as e:
    raise ShardFormatError(
        f"{path}: corrupt manifest, invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
    ) from e


def load_manifest(root: Path) -> dict[str, Any]:
  """Reads and checks the manifest's fields and types (not the shard files)."""
  if not root.exists():
    raise ShardFormatError(f"{root}: dataset directory does not exist")
  if not root.is_dir():
    raise ShardFormatError(f"{root}: not a directory")
  path = root / MANIFEST_NAME
  if not path.exists():
    unfinished = sorted(p.name for p in root.iterdir() if OWNED_FILE.match(p.name))
    hint = (f" (it holds {len(unfinished)} shard files of an unfinished write; rerun the "
            f"tokenizer to complete it)" if unfinished else "")
    raise ShardFormatError(f"{path}: missing manifest{hint}")
  manifest = read_manifest(path)
  require(isinstance(manifest, dict), path, f"corrupt manifest, expected an object, got "
           f"{type(manifest).__name__}")
  require(manifest.get("format") == FORMAT_NAME, path,
           f"format is {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
  require(manifest.get("format_version") == FORMAT_VERSION, path,
           f"unsupported format_version {manifest.get('format_version')!r} (this reader: "
           f"{FORMAT_VERSION})")
  vocab = manifest.get("vocab_size")
  require(isinstance(vocab, int) and not isinstance(vocab, bool) and 1 <= vocab <= 2**32, path,
           f"vocab_size must be an int in [1, 2**32], got {vocab!r}")
  require(manifest.get("dtype") == dtype_for_vocab(vocab).name, path,
           f"dtype {manifest.get('dtype')!r} does not match vocab_size {vocab} (expected "
           f"{dtype_for_vocab(vocab).name!r})")
  require(isinstance(manifest.get("tokenizer_fingerprint"), str), path,
           f"tokenizer_fingerprint must be a string, got "
           f"{manifest.get('tokenizer_fingerprint')!r}")
  shards = manifest.get("shards")
  require(isinstance(shards, list), path, f"shards must be a list, got {shards!r:.80}")
  for i, shard in enumerate(shards):
    ok = (isinstance(shard, dict)
          and all(isinstance(shard.get(k), str) and "/" not in shard[k]
                  and shard[k] not in ("", ".", "..") for k in ("tokens", "offsets"))
          and all(isinstance(shard.get(k), int) and shard[k] >= 0
                  for k in ("num_documents", "num_tokens"))
          and isinstance(shard.get("sha256"), dict)
          and all(isinstance(shard["sha256"].get(k), str) for k in ("tokens", "offsets")))
    require(ok, path, f"shards[{i}] is malformed: {shard!r:.200}")
    top = shard.get("max_token")
    require(top is None or (isinstance(top, int) and not isinstance(top, bool) and top >= 0),
             path, f"shards[{i}].max_token must be an int >= 0 when present, got {top!r}")
  has_mask = manifest.get("loss_mask", False)
  require(isinstance(has_mask, bool), path, f"loss_mask must be true or false, got {has_mask!r}")
  for i, shard in enumerate(shards if has_mask else ()):
    name = shard.get("mask")
    require(isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
             and isinstance(shard["sha256"].get("mask"), str), path,
             f"loss_mask is true but shards[{i}] has no valid mask file and sha256: {shard!r:.200}")
  for key in ("num_documents", "num_tokens"):
    total = sum(s[key] for s in shards)
    require(manifest.get(key) == total, path,
             f"{key} is {manifest.get(key)!r} but the shards sum to {total}")
  want, got = manifest.get("metadata_sha256"), metadata_sha256(manifest.get("metadata"))
  require(want == got, path, f"metadata does not match metadata_sha256 (the manifest was "
           f"damaged or edited): {got} but the manifest says {want!r:.80}")
  return manifest


def check_offsets(offsets: np.ndarray, path: Path, num_tokens: int) -> None:
  """Offsets start at 0, never decrease and end at the token count."""
  require(int(offsets[0]) == 0, path, f"first offset is {int(offsets[0])}, expected 0")
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
  require(int(offsets[-1]) == num_tokens, path,
           f"last offset is {int(offsets[-1])} but the shard holds {num_tokens} tokens")

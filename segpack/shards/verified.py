"""Remembered shard verification: the files this machine hashed and found intact.

`ShardSource(path)` hashes every shard file once per machine and records the result in
`$SEGPACK_CACHE/verified.json` (default `~/.cache/segpack/verified.json`, the same root as the
built-in corpus), keyed by the file's absolute path. An entry holds the checksum that matched and
the file's `(size, mtime_ns, ctime_ns, inode, device)`; a later open skips the hash while all of
them are unchanged. `ctime_ns` is set by the kernel on every write, rename or `os.utime`, so a
byte changed in place is noticed even when the modification time is restored afterwards.

The file is small JSON, written atomically; concurrent writers read, merge and write it under an
exclusive lock (`verified.json.lock`), and entries whose file no longer exists are dropped then.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from segpack import files

VERIFIED_NAME = "verified.json"
_log = logging.getLogger(__name__)


def cache_file() -> Path:
  """`$SEGPACK_CACHE/verified.json`, else `~/.cache/segpack/verified.json`."""
  env = os.environ.get("SEGPACK_CACHE")
  root = Path(env) if env else Path("~/.cache/segpack")
  return root.expanduser() / VERIFIED_NAME


def file_key(path: Path) -> list[int]:
  """What must stay unchanged for a verification to be reused: size, times, inode, device."""
  st = os.stat(path)
  return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def entry_name(path: Path) -> str:
  """The cache key of a file: its absolute path, symbolic links resolved."""
  return str(Path(path).resolve())


class VerifiedCache:
  """The set of verified files, read once per `ShardSource` open and merged on write.

  Example: after `record({"/d/shard-00000.tokens": {"sha256": h, "key": [...]}})`, a new
  `VerifiedCache().lookup(Path("/d/shard-00000.tokens"), h)` returns that entry while the file's
  `file_key` is unchanged, else None.
  """

  def __init__(self, path: Path | None = None):
    """Uses `path`, else `cache_file()`."""
    self.path = path if path is not None else cache_file()
    self._entries: dict[str, Any] | None = None

  def _read(self) -> dict[str, Any]:
    try:
      data = json.loads(self.path.read_text("utf-8"))
    except FileNotFoundError:
      return {}
    except (OSError, ValueError) as e:
      _log.warning("ignoring unreadable shard verification cache %s (%s)", self.path, e)
      return {}
    return data if isinstance(data, dict) else {}

  def lookup(self, path: Path, sha256: str) -> dict[str, Any] | None:
    """The entry of `path` when it was verified against `sha256` and has not changed since."""
    if self._entries is None:
      self._entries = self._read()
    entry = self._entries.get(entry_name(path))
    if not isinstance(entry, dict) or entry.get("sha256") != sha256:
      return None
    try:
      return entry if entry.get("key") == file_key(path) else None
    except OSError:
      return None

  def record(self, updates: dict[str, dict[str, Any]]) -> None:
    """Adds `updates` (entry name -> entry); a cache that cannot be written is only logged."""
    if not updates:
      return
    lock = self.path.with_name(self.path.name + ".lock")
    try:
      with files.file_lock(lock):
        entries = self._read()
        entries = {k: v for k, v in entries.items() if os.path.exists(k)}
        entries.update(updates)
        data = json.dumps(entries, sort_keys=True, separators=(",", ":")) + "\n"
        files.atomic_write_bytes(self.path, data.encode("utf-8"))
    except OSError as e:
      _log.warning("cannot write the shard verification cache %s (%s); shards will be "
                   "verified again on the next open", self.path, e)
      return
    self._entries = entries

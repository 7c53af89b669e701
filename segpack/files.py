"""File helpers shared by every writer: atomic writes, durable renames, hashes and locks.

A crash never leaves a file that looks valid: every write goes to a temporary file in the same
directory, is flushed and fsynced, and is then renamed over the target (`os.replace`, atomic on
POSIX), after which the directory itself is fsynced so the rename survives a power loss.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "atomic_write_json", "file_lock", "fsync_dir", "sha256_file"]

_HASH_BLOCK = 1 << 24


def fsync_dir(path: Path) -> None:
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
    fsync_dir(path.parent)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def atomic_write_json(path: Path, obj: Any) -> None:
  """Writes `obj` as indented, key-sorted JSON to `path`, atomically."""
  atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def sha256_file(path: str | os.PathLike[str]) -> str:
  """The hex SHA-256 of a file, read in 16 MiB blocks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(_HASH_BLOCK):
      digest.update(block)
  return digest.hexdigest()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
  """An exclusive advisory lock (several processes may build the same cache entry)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a+b") as f:
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f.fileno(), fcntl.LOCK_UN)

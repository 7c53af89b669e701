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
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from segpack.errors import UserError

__all__ = ["LockHeldError", "atomic_write_bytes", "atomic_write_json", "file_lock", "fsync_dir",
           "sha256_file"]

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


def atomic_write_bytes(path: Path, data: bytes, *, replace: bool = True) -> None:
  """Writes `data` to `path` through a temporary file in the same directory and a rename; with
  `replace=False` through a hard link instead, which raises `FileExistsError` rather than
  replace a file that is there (one another process wrote meanwhile)."""
  # Not tempfile.mkstemp: its files are mode 0600, these should follow the umask like any other.
  tmp = path.parent / f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
  try:
    with open(tmp, "xb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    if replace:
      os.replace(tmp, path)
    else:
      os.link(tmp, path)
      os.unlink(tmp)
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


class LockHeldError(UserError, OSError):
  """`file_lock(path, wait=False)`: another process holds the lock; `owner` is what it wrote
  into the lock file (pid, host, start time), or a note that it wrote nothing readable."""

  def __init__(self, path: Path, owner: str):
    super().__init__(f"{path}: locked by another process ({owner})")
    self.path = path
    self.owner = owner


def _recorded_owner(f: Any) -> str | None:
  """The owner line the lock file records, or None: nothing readable yet, or the record of an
  earlier holder on this host that has exited (the new holder has not written its own yet)."""
  f.seek(0)
  try:
    info = json.loads(f.read(4096).decode("utf-8"))
    pid, host = int(info["pid"]), str(info["host"])
    owner = f"pid {pid} on host {host}, started {info['started']}"
  except (ValueError, KeyError, TypeError):
    return None
  if host == socket.gethostname():
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return None
    except PermissionError:  # alive, another user's
      pass
  return owner


def _lock_owner(f: Any, *, patience_s: float = 1.0) -> str:
  """The owner line of a lock file another process holds (written by `file_lock(...,
  wait=False)` just after it took the lock): waits up to `patience_s` for a holder that took it
  a moment ago to write its record."""
  deadline = time.monotonic() + patience_s
  while (owner := _recorded_owner(f)) is None and time.monotonic() < deadline:
    time.sleep(0.02)
  return owner or "its pid is not recorded in the lock file"


def _is_current(path: Path, f: Any) -> bool:
  """Whether the open file `f` is still the file at `path` (not removed or replaced)."""
  try:
    return os.path.samestat(os.stat(path), os.fstat(f.fileno()))
  except FileNotFoundError:
    return False


@contextlib.contextmanager
def file_lock(path: Path, *, wait: bool = True, remove: bool = False) -> Iterator[None]:
  """An exclusive advisory lock (`fcntl.flock`), held until the block ends.

  The operating system drops the lock when its holder exits, also when it is killed, so a crash
  never leaves a stale lock. The file itself stays unless `remove`: then the holder removes it
  while it still holds the lock, and whoever locks a file checks that it is still the one at
  `path` (else it locks the new one), so a process that opened the removed file never holds the
  lock beside a newcomer.

  Args:
    path: the lock file, created with its parent directory when missing.
    wait: True (several processes may build the same cache entry): block until the lock is
      free. False: raise `LockHeldError` when another process holds it, naming the holder
      (read from the file: at most a second's wait for one that has just taken the lock); once
      acquired, the file records this process's pid, host and start time for that message.
    remove: remove the lock file when the block ends (a lock beside a user's output).
  """
  path.parent.mkdir(parents=True, exist_ok=True)
  while True:
    with open(path, "a+b") as f:
      try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
      except BlockingIOError:
        raise LockHeldError(path, _lock_owner(f)) from None
      try:
        if remove and not _is_current(path, f):
          continue  # its holder removed it after we opened it: lock the file at `path` now
        if not wait:
          f.seek(0)
          f.truncate()
          started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
          f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "started": started}).encode("utf-8"))
          f.flush()
        try:
          yield
        finally:
          if remove:
            with contextlib.suppress(FileNotFoundError):
              os.unlink(path)
        return
      finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)

"""The sha256 digest of a checkpoint's files: written after a save, checked before a restore.

A checkpoint `checkpoints/<step>/` gets `digest.json` once orbax has finished writing it:
`{"format": 1, "step": S, "files": {"state/_METADATA": {"bytes": N, "sha256": HEX}, ...}}`,
one entry for every file under the step directory (`digest.json` itself excepted), written
atomically (a temporary file, then a rename). `problem(step_dir, step)` rereads every file and
returns what differs (a missing, extra, resized or changed file, named by its path), or None when
the checkpoint is byte for byte what was saved.

Which checkpoints count as verified (`steps_to_remove` never removes the newest of them): one
this process saved and whose digest it recorded, and one whose digest was checked on restore.

What a checkpoints directory may hold (`scan`): the steps, entries named as orbax names a step
(`0`, or digits without a leading zero), each intact or damaged (`problem`: a file, a symbolic
link, a directory that differs from its digest); orbax's temporary directories of saves that did
not finish (`7.orbax-checkpoint-tmp`, `7.orbax-checkpoint-tmp-1712345678`); and anything else
(`06`, `step_9`, a stray file), which is no checkpoint and is skipped (hidden names, `.*`, are
not listed). The trainer and `train.sample` both choose the newest intact step of
`scan(...).steps`, so they agree.

Writing (`check_writable`, `write_errno`): the trainer writes a byte into the directory when it
starts, so a read-only or full one stops it before its first step, and a save that fails for the
disk (`write_errno`: an OSError, or orbax's `[os_error_code='28']`) becomes one line naming the
directory and its free space (`CheckpointWriteError`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from typing import Any

from segpack import errors
from segpack.errors import UserError

DIGEST_FILE = "digest.json"
DIGEST_FORMAT = 1
_CHUNK = 1 << 20
# Orbax's own names: a step is `0` or digits without a leading zero (its standard name format);
# a save in progress writes `<step>.orbax-checkpoint-tmp[-<timestamp>]` and renames it at the end.
STEP_NAME = re.compile(r"0|[1-9][0-9]*")
UNFINISHED_NAME = re.compile(r"[0-9]+\.orbax-checkpoint-tmp(-[0-9]+)?")
MAX_STEP = 2**31 - 1  # the trainer counts steps in an int32


class DamagedCheckpointError(UserError, ValueError):
  """No checkpoint in the workdir is intact (or the checkpoints path is not a directory)."""


class CheckpointWriteError(UserError, RuntimeError):
  """The checkpoints directory cannot be written: at the start (read-only, no permission, full)
  or during a save (the disk filled up); the message names it and its free space."""


# The errno values of a write that failed for the disk, not for the code: full, over quota,
# read-only, no permission, an I/O error, a file too large.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                           errno.EIO, errno.EFBIG})
# How orbax's array writes (tensorstore) report an OS error, e.g. a full disk: `ValueError:
# RESOURCE_EXHAUSTED: Error writing ... No space left on device [os_error_code='28']`.
_OS_ERROR_CODE = re.compile(r"os_error_code='?([0-9]+)")


def write_errno(error: BaseException | None) -> int | None:
  """The errno of a failed write that `error`, or an exception it was raised from, reports: an
  `OSError`'s own, or the `[os_error_code='N']` of orbax's array writes. None when it is no
  write failure (a bug, which keeps its traceback)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    code = error.errno if isinstance(error, OSError) else None
    if code is None and (match := _OS_ERROR_CODE.search(str(error))):
      code = int(match.group(1))
    if code in _WRITE_ERRNOS:
      return code
    error = error.__cause__ or error.__context__
  return None


def human(n: float) -> str:
  """`1536` -> `"1.5 KiB"`."""
  units, i = ("B", "KiB", "MiB", "GiB", "TiB"), 0
  while n >= 1024 and i < len(units) - 1:
    n, i = n / 1024, i + 1
  return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def free_space(directory: str) -> str:
  """`"1.2 MiB free of 2.0 GiB"` on the file system of `directory` (`shutil.disk_usage`)."""
  try:
    usage = shutil.disk_usage(directory)
  except OSError as e:
    return f"its free space is unknown: {e.strerror or e}"
  return f"{human(usage.free)} free of {human(usage.total)}"


def tree_bytes(path: str) -> int | None:
  """The bytes of the files under `path` (None when they cannot be listed)."""
  try:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path)
               for n in names)
  except OSError:
    return None


def check_writable(directory: str) -> None:
  """Creates `directory` if needed, then writes, syncs and removes a one-byte file in it: a
  read-only file system, a directory without write permission or a full disk stops the run here,
  before its first step, not at its first save.

  Raises:
    CheckpointWriteError: `directory` cannot be created or written (one line naming it, the
      reason and its free space).
  """
  what = "cannot be created"
  try:
    os.makedirs(directory, exist_ok=True)
    what = "is not writable"
    fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=directory)
    try:
      os.write(fd, b"0")
      os.fsync(fd)
    finally:
      os.close(fd)
      os.remove(probe)
  except OSError as e:
    raise CheckpointWriteError(
        f"{directory} {what} ({e.strerror or e}; {free_space(_existing(directory))}): the run's "
        "checkpoints go there; make it writable (or free some space), or use another --workdir"
    ) from e


def _existing(path: str) -> str:
  """`path`, or its nearest ancestor that exists (whose file system `free_space` reports)."""
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


@dataclasses.dataclass(frozen=True)
class Listing:
  """The entries of a checkpoints directory, sorted by kind (`scan`).

  Attributes:
    directory: the checkpoints directory.
    steps: the steps of the entries named like a step, newest first: each is a checkpoint,
      intact or damaged (`problem` says which).
    unfinished: names of orbax's temporary directories of saves that did not finish.
    other: names of every other entry, sorted (no checkpoint: skipped).
  """

  directory: str
  steps: list[int]
  unfinished: list[str]
  other: list[str]

  def skipped_line(self) -> str | None:
    """One line naming the entries that are no checkpoint (`other`, at most 5 named), or None
    when there is none."""
    if not self.other:
      return None
    names = ", ".join(repr(n) for n in self.other[:5])
    more = f" and {len(self.other) - 5} more" if len(self.other) > 5 else ""
    return (f"{self.directory}: skipped {names}{more}: not a checkpoint (a step directory is "
            "named by its step, digits without a leading zero)")


def scan(directory: str) -> Listing:
  """Sorts the entries of `directory` (none when it is not a directory) by kind, by name only:
  nothing is opened, so a symbolic link to itself or an unreadable entry cannot stop it. Hidden
  names (`.write-check-*` of `check_writable`, `.nfs*`) are left out.

  Example: `2`, `4`, `04`, `7.orbax-checkpoint-tmp`, `notes` -> steps `[4, 2]`, unfinished
  `["7.orbax-checkpoint-tmp"]`, other `["04", "notes"]`.
  """
  try:
    names = os.listdir(directory) if os.path.isdir(directory) else []
  except OSError:
    names = []
  names = [n for n in names if not n.startswith(".")]
  steps = [int(n) for n in names if STEP_NAME.fullmatch(n)]
  unfinished = sorted(n for n in names if UNFINISHED_NAME.fullmatch(n))
  other = sorted(set(names) - {str(s) for s in steps} - set(unfinished))
  return Listing(directory=directory, steps=sorted(steps, reverse=True), unfinished=unfinished,
                 other=other)


def remove_unfinished(directory: str, names: list[str]) -> list[str]:
  """Removes the entries `names` of `directory` (orbax's temporary directories of saves that did
  not finish; a file or a link is unlinked, not followed); returns the paths it could not remove,
  each with the reason."""
  failed = []
  for name in names:
    path = os.path.join(directory, name)
    try:
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
      else:
        os.remove(path)
    except OSError as e:
      failed.append(f"{path} ({e.strerror or e})")
  return failed


def remove_save(directory: str, step: int) -> list[str]:
  """Removes what a save of `step` that did not finish left in `directory`: orbax's temporary
  directories of it, and `step` itself (renamed into place, its digest perhaps not written);
  returns what could not be removed, as `remove_unfinished` does."""
  try:
    names = os.listdir(directory)
  except OSError as e:
    return [f"{directory} ({e.strerror or e})"]
  return remove_unfinished(directory, [n for n in names if n == str(step) or (
      UNFINISHED_NAME.fullmatch(n) and n.split(".")[0] == str(step))])


def _regular_file(path: str) -> os.stat_result:
  """`os.stat(path)`, or OSError when `path` is not a regular file (a FIFO would block a read)."""
  st = os.stat(path)
  if not stat.S_ISREG(st.st_mode):
    raise OSError("not a regular file")
  return st


def file_sha256(path: str) -> str:
  """The hex sha256 of the file at `path`, read in 1 MiB chunks.

  Raises:
    OSError: it cannot be read, or it is not a regular file.
  """
  h = hashlib.sha256()
  _regular_file(path)
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _files(step_dir: str) -> list[str]:
  """Paths relative to `step_dir` (with `/`) of every file under it, `DIGEST_FILE` excepted."""
  out = []
  for root, dirs, names in os.walk(step_dir):
    dirs.sort()
    for name in sorted(names):
      rel = os.path.relpath(os.path.join(root, name), step_dir).replace(os.sep, "/")
      if rel != DIGEST_FILE and not rel.startswith(DIGEST_FILE + ".tmp"):
        out.append(rel)
  return out


def compute(step_dir: str) -> dict[str, dict[str, Any]]:
  """`{relative path: {"bytes": size, "sha256": hex}}` of every file under `step_dir`."""
  return {rel: {"bytes": os.path.getsize(os.path.join(step_dir, rel)),
                "sha256": file_sha256(os.path.join(step_dir, rel))} for rel in _files(step_dir)}


def write(step_dir: str, step: int) -> str:
  """Hashes every file of the finished checkpoint `step_dir` and writes its `DIGEST_FILE`
  atomically (a temporary file, flushed and synced, then renamed); returns the digest's path.

  Raises:
    OSError: a file cannot be read, or the digest cannot be written.
  """
  record = {"format": DIGEST_FORMAT, "step": step, "files": compute(step_dir)}
  path = os.path.join(step_dir, DIGEST_FILE)
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(record, f, indent=0, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def _read(step_dir: str, step: int) -> tuple[dict[str, Any] | None, str | None]:
  """`(files of the digest, None)`, or `(None, what is wrong with the digest file)`."""
  path = os.path.join(step_dir, DIGEST_FILE)
  if not os.path.lexists(path):
    try:
      if not os.listdir(step_dir):
        return None, "the directory is empty"
    except OSError as e:
      return None, f"cannot list it ({errors.one_line(e)})"
    return None, (f"it has no {DIGEST_FILE} (written before checkpoints carried a digest, or its "
                  "save did not finish), so it cannot be verified")
  try:
    _regular_file(path)
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    return None, f"{path} is unreadable ({errors.one_line(e)})"
  files = record.get("files") if isinstance(record, dict) else None
  if (not isinstance(files, dict) or record.get("format") != DIGEST_FORMAT
      or record.get("step") != step
      or not all(isinstance(v, dict) and isinstance(v.get("bytes"), int)
                 and isinstance(v.get("sha256"), str) for v in files.values())):
    return None, (f"{path} is not a format-{DIGEST_FORMAT} digest of step {step}")
  return files, None


def problem(step_dir: str, step: int) -> str | None:
  """What makes the checkpoint `step_dir` differ from its digest, naming the file; None if it
  is intact (every file of the digest present with its size and sha256, and no other file).

  A step entry that is a symbolic link (even to a checkpoint) or not a directory is damaged:
  the trainer writes real directories, and rotation and quarantine move the entry itself."""
  if os.path.islink(step_dir):
    try:
      target = os.readlink(step_dir)
    except OSError:
      target = "?"
    return f"{step_dir} is a symbolic link (to {target}), not a checkpoint directory"
  if not os.path.isdir(step_dir):
    return f"{step_dir} is not a directory"
  if step > MAX_STEP:
    return f"step {step} is beyond the trainer's step counter (at most {MAX_STEP})"
  want, bad = _read(step_dir, step)
  if bad is not None:
    return bad
  try:
    have = _files(step_dir)
  except OSError as e:
    return f"cannot list it ({e})"
  missing = sorted(set(want) - set(have))
  if missing:
    more = f" and {len(missing) - 1} more file(s) of its digest" if len(missing) > 1 else ""
    return f"{os.path.join(step_dir, missing[0])} is missing{more}"
  extra = sorted(set(have) - set(want))
  if extra:
    return f"{os.path.join(step_dir, extra[0])} is not in its digest (added after the save)"
  for rel in sorted(want):
    path = os.path.join(step_dir, rel)
    try:
      size = _regular_file(path).st_size
      if size != want[rel]["bytes"]:
        return f"{path} has {size} bytes, its digest says {want[rel]['bytes']}"
      if file_sha256(path) != want[rel]["sha256"]:
        return f"{path} differs from its sha256 digest"
    except OSError as e:
      return f"{path} cannot be read ({e})"
  return None


def step_dirs(directory: str) -> list[int]:
  """The steps of `directory`'s checkpoints, newest first (`scan(directory).steps`)."""
  return scan(directory).steps


def steps_to_remove(steps: list[int], *, verified: set[int], keep: int) -> list[int]:
  """The steps rotation deletes: all but the `keep` newest and the newest verified one.

  Example: steps `[8, 6, 4, 2]`, verified `{4}` (6 and 8 saved without a recorded digest),
  `keep=2`: removes `[2]` only; 8 and 6 are the newest two and 4 is the newest verified.
  """
  kept = set(sorted(steps, reverse=True)[:max(keep, 1)])
  if verified:
    kept.add(max(verified))
  return sorted(s for s in steps if s not in kept)


def quarantine_path(directory: str, step: int) -> str:
  """Where a damaged checkpoint `directory/<step>` is moved: `<workdir>/damaged_checkpoints/
  <step>` (`-1`, `-2`, ... appended when that exists), next to the checkpoints directory.

  When `damaged_checkpoints` exists but is no directory (a file, a broken link), the first of
  `damaged_checkpoints-1`, `-2`, ... that is a directory or does not exist takes its place.
  """
  root = base_root = os.path.join(os.path.dirname(directory), "damaged_checkpoints")
  n = 0
  while os.path.lexists(root) and not os.path.isdir(root):
    n += 1
    root = f"{base_root}-{n}"
  base = os.path.join(root, str(step))
  path, n = base, 0
  while os.path.lexists(path):
    n += 1
    path = f"{base}-{n}"
  return path

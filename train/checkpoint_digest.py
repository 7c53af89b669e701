"""The sha256 digest of a checkpoint's files: written after a save, checked before a restore.

A checkpoint `checkpoints/<step>/` gets `digest.json` once orbax has finished writing it:
`{"format": 1, "step": S, "files": {"state/_METADATA": {"bytes": N, "sha256": HEX}, ...}}`,
one entry for every file under the step directory (`digest.json` itself excepted), written
atomically (a temporary file, then a rename). `problem(step_dir, step)` rereads every file and
returns what differs (a missing, extra, resized or changed file, named by its path), or None when
the checkpoint is byte for byte what was saved.

Which checkpoints count as verified (`steps_to_remove` never removes the newest of them): one
this process saved and whose digest it recorded, and one whose digest was checked on restore.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

DIGEST_FILE = "digest.json"
DIGEST_FORMAT = 1
_CHUNK = 1 << 20


class DamagedCheckpointError(ValueError):
  """No checkpoint in the workdir is intact (or the checkpoints path is not a directory)."""


def file_sha256(path: str) -> str:
  """The hex sha256 of the file at `path`, read in 1 MiB chunks."""
  h = hashlib.sha256()
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
  if not os.path.exists(path):
    if not os.listdir(step_dir):
      return None, "the directory is empty"
    return None, (f"it has no {DIGEST_FILE} (written before checkpoints carried a digest, or its "
                  "save did not finish), so it cannot be verified")
  try:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    return None, f"{path} is unreadable ({' '.join(str(e).split())})"
  files = record.get("files") if isinstance(record, dict) else None
  if (not isinstance(files, dict) or record.get("format") != DIGEST_FORMAT
      or record.get("step") != step
      or not all(isinstance(v, dict) and {"bytes", "sha256"} <= set(v) for v in files.values())):
    return None, (f"{path} is not a format-{DIGEST_FORMAT} digest of step {step}")
  return files, None


def problem(step_dir: str, step: int) -> str | None:
  """What makes the checkpoint `step_dir` differ from its digest, naming the file; None if it
  is intact (every file of the digest present with its size and sha256, and no other file)."""
  if not os.path.isdir(step_dir):
    return f"{step_dir} is not a directory"
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
      size = os.path.getsize(path)
      if size != want[rel]["bytes"]:
        return f"{path} has {size} bytes, its digest says {want[rel]['bytes']}"
      if file_sha256(path) != want[rel]["sha256"]:
        return f"{path} differs from its sha256 digest"
    except OSError as e:
      return f"{path} cannot be read ({e})"
  return None


def step_dirs(directory: str) -> list[int]:
  """The steps of `directory`'s checkpoint directories (all-digit names), newest first."""
  if not os.path.isdir(directory):
    return []
  return sorted((int(n) for n in os.listdir(directory)
                 if n.isdigit() and os.path.isdir(os.path.join(directory, n))), reverse=True)


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
  <step>` (`-1`, `-2`, ... appended when that exists), next to the checkpoints directory."""
  base = os.path.join(os.path.dirname(directory), "damaged_checkpoints", str(step))
  path, n = base, 0
  while os.path.exists(path):
    n += 1
    path = f"{base}-{n}"
  return path

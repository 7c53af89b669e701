"""The packing `Plan`: which pieces of which documents fill each row, and its on-disk form."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from segpack import files
from segpack.errors import UserError

FORMAT_VERSION = 1
_ARRAYS = ("row_splits", "doc", "start", "length")
_META = "plan.json"
CHECKSUMS = "sha256.json"
_BLOCK = 1 << 22


class PlanError(UserError, ValueError):
  """A plan on disk or in memory is malformed; the message names the file or field."""


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """A packing plan: row `r` holds pieces `row_splits[r]:row_splits[r + 1]`.

  Each piece is `(doc, start, length)`: `length` virtual slots of document `doc` starting at
  virtual slot `start` (virtual slot 0 is BOS when the pipeline adds one; see
  `segpack.packing.plan`). Pieces are stored in row order and, inside a row, in the order their
  segments appear.

  Reading row `r`:
    1. its pieces are `row_splits[r]:row_splits[r + 1]`;
    2. piece `i` fills the next `length[i]` slots with virtual slots
       `start[i]:start[i] + length[i]` of document `doc[i]`;
    3. the slots after the last piece are padding.

  On disk (`save`) a plan is a directory of one `.npy` file per array, `plan.json` and
  `sha256.json` (the SHA-256 of each of those files), which `load` checks by default.

  A plan loaded with `mmap=True` pickles its arrays as file references (`__reduce__`), so a
  dataset that holds it is cheap to send to worker processes.

  Example: seq_len 8 and documents of 5, 3 and 6 virtual slots under `ffd`: the 6 opens row 0,
  the 5 opens row 1, the 3 does not fit row 0 (room 2) and joins row 1. So `row_splits` =
  [0, 1, 3], `doc` = [2, 0, 1], `start` = [0, 0, 0], `length` = [6, 5, 3]; row 0 is document 2
  and 2 padding slots, row 1 is document 0 then document 1.

  Attributes:
    seq_len: slots per row.
    overlap: slots a continuation chunk (`start > 0`) repeats from the previous chunk.
    extra_tokens: virtual slots added to every document (`add_bos + add_eos`).
    strategy: the packer that made the plan.
    row_splits: int64 `[num_rows + 1]`, starting at 0 and ending at `num_pieces`.
    doc: `[num_pieces]` document indices: int32 (int64 from 2**31 documents).
    start: int32 `[num_pieces]` first virtual slot of each piece.
    length: `[num_pieces]` slots of each piece, `1 <= length <= seq_len`: uint16 (int32 for
      seq_len above 65535). `load` refuses other dtypes (a plan cache recomputes such a plan).
    stats: plain-JSON statistics (`documents`, `dropped`, `split`, `truncated`, `chunks`,
      `tokens`, `slots`, `lower_bound`, ...).
  """

  seq_len: int
  overlap: int
  extra_tokens: int
  strategy: str
  row_splits: np.ndarray
  doc: np.ndarray
  start: np.ndarray
  length: np.ndarray
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    n = len(self.doc)
    for name in ("start", "length"):
      if len(getattr(self, name)) != n:
        raise PlanError(
            f"Plan.{name} has {len(getattr(self, name))} entries but Plan.doc has {n}")
    if self.row_splits.ndim != 1 or len(self.row_splits) < 1:
      raise PlanError(f"Plan.row_splits must be 1-D and non-empty, got shape "
                      f"{self.row_splits.shape}")
    if int(self.row_splits[0]) != 0 or int(self.row_splits[-1]) != n:
      raise PlanError(f"Plan.row_splits must run from 0 to num_pieces={n}, got "
                      f"{int(self.row_splits[0])}..{int(self.row_splits[-1])}")

  def __reduce__(self):
    # A memory-mapped plan (a cached one) travels to Grain workers as file references.
    arrays = [_pickle_array(getattr(self, name)) for name in _ARRAYS]
    return _restore_plan, (self.seq_len, self.overlap, self.extra_tokens, self.strategy,
                           self.stats, *arrays)

  @property
  def num_rows(self) -> int:
    return len(self.row_splits) - 1

  @property
  def num_pieces(self) -> int:
    return len(self.doc)

  @property
  def nbytes(self) -> int:
    """Bytes held by the plan's arrays."""
    return sum(int(getattr(self, name).nbytes) for name in _ARRAYS)

  def row(self, r: int) -> list[tuple[int, int, int]]:
    """The pieces `(doc, start, length)` of row `r`, in segment order."""
    if not 0 <= r < self.num_rows:
      raise IndexError(f"row {r} out of range for a plan of {self.num_rows} rows")
    a, b = int(self.row_splits[r]), int(self.row_splits[r + 1])
    return [(int(d), int(s), int(n)) for d, s, n in
            zip(self.doc[a:b], self.start[a:b], self.length[a:b])]

  def row_lengths(self) -> np.ndarray:
    """Occupied slots per row, int64 `[num_rows]`."""
    csum = np.concatenate([[0], np.cumsum(self.length, dtype=np.int64)])
    return csum[self.row_splits[1:]] - csum[self.row_splits[:-1]]

  def meta(self) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "seq_len": int(self.seq_len),
            "overlap": int(self.overlap), "extra_tokens": int(self.extra_tokens),
            "strategy": self.strategy, "num_rows": self.num_rows,
            "num_pieces": self.num_pieces, "stats": self.stats}

  def save(self, path: str | os.PathLike, *, overwrite: bool = True) -> bool:
    """Writes the plan to directory `path` atomically (temporary directory, then rename).

    Args:
      path: the plan directory.
      overwrite: replace an existing plan at `path`; when False an existing plan is kept (a
        concurrent writer of the same plan got there first).

    Returns:
      Whether this call's plan is now at `path`.
    """
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-plan-", dir=parent)
    try:
      for name in _ARRAYS:
        np.save(os.path.join(tmp, name + ".npy"), np.ascontiguousarray(getattr(self, name)))
      with open(os.path.join(tmp, _META), "w") as f:
        json.dump(self.meta(), f, indent=1, sort_keys=True)
      sums = {name: files.sha256_file(os.path.join(tmp, name))
              for name in [a + ".npy" for a in _ARRAYS] + [_META]}
      files.atomic_write_json(Path(tmp) / CHECKSUMS, sums)
      if not overwrite:
        try:
          os.rename(tmp, path)
          return True
        except OSError:
          if not os.path.isdir(path):
            raise
          shutil.rmtree(tmp, ignore_errors=True)
          return False
      _replace_dir(tmp, path)
      return True
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise

  @classmethod
  def load(cls, path: str | os.PathLike, *, mmap: bool = True, verify: bool = True) -> "Plan":
    """Reads a plan saved by `save`; with `mmap` the arrays are read-only memory maps.

    With `verify` (default) every file must match the SHA-256 that `save` recorded beside it in
    `sha256.json` (a plan written without one is refused); a mismatch raises PlanError naming the
    file and both checksums.
    """
    path = os.fspath(path)
    meta_path = os.path.join(path, _META)
    meta = _read_json(meta_path, missing=f"no plan at {path!r}: {meta_path!r} is missing")
    if meta.get("format_version") != FORMAT_VERSION:
      raise PlanError(f"{meta_path!r} has format_version={meta.get('format_version')!r}, "
                      f"expected {FORMAT_VERSION}")
    if verify:
      check_checksums(path)
    arrays = {}
    for name in _ARRAYS:
      file = os.path.join(path, name + ".npy")
      try:
        arrays[name] = np.load(file, mmap_mode="r" if mmap else None)
      except (OSError, ValueError) as e:
        raise PlanError(f"cannot read plan array {file!r}: {e}") from e
    plan = cls(seq_len=int(meta["seq_len"]), overlap=int(meta["overlap"]),
               extra_tokens=int(meta["extra_tokens"]), strategy=str(meta["strategy"]),
               stats=dict(meta.get("stats", {})), **arrays)
    _check_dtypes(plan, path)
    if plan.num_rows != meta.get("num_rows") or plan.num_pieces != meta.get("num_pieces"):
      raise PlanError(f"{path!r}: arrays hold {plan.num_rows} rows / {plan.num_pieces} pieces "
                      f"but {_META} says {meta.get('num_rows')} / {meta.get('num_pieces')}")
    return plan


def _read_json(file: str, *, missing: str) -> Any:
  """The JSON in `file`; a PlanError with `missing` when it does not exist, naming it otherwise."""
  try:
    with open(file) as f:
      return json.load(f)
  except FileNotFoundError as e:
    raise PlanError(missing) from e
  except json.JSONDecodeError as e:
    raise PlanError(f"{file!r} is not valid JSON: {e}") from e
  except (OSError, ValueError) as e:
    raise PlanError(f"cannot read {file!r}: {e}") from e


def check_checksums(path: str) -> None:
  """Every file of the plan at `path` matches `sha256.json`; raises PlanError naming the file."""
  sums_path = os.path.join(path, CHECKSUMS)
  sums = _read_json(sums_path,
                    missing=f"{sums_path!r} is missing (a plan written without checksums)")
  for name in [a + ".npy" for a in _ARRAYS] + [_META]:
    file = os.path.join(path, name)
    want = sums.get(name) if isinstance(sums, dict) else None
    try:
      got = files.sha256_file(file)
    except OSError as e:
      raise PlanError(f"cannot read plan file {file!r}: {e}") from e
    if got != want:
      raise PlanError(f"{file!r}: checksum mismatch: sha256 {got} but {CHECKSUMS} says {want!r}")


def check_plan(plan: Plan, lengths: np.ndarray, path: str) -> None:
  """The structural invariants of `plan` for documents of `lengths` tokens (raises PlanError).

  `row_splits` never decreases; every piece has `0 <= doc < len(lengths)`, `0 <= start`,
  `1 <= length <= seq_len` and ends inside its document's virtual slots
  (`start + length <= lengths[doc] + extra_tokens`); no row holds more than `seq_len` slots.
  Arrays are read in blocks, so a memory-mapped plan is never copied whole.
  """
  steps = np.diff(np.asarray(plan.row_splits, dtype=np.int64))
  if steps.size and int(steps.min()) < 0:
    r = int(np.argmax(steps < 0))
    raise PlanError(f"{path!r}: row_splits decrease at row {r}: {int(plan.row_splits[r])} > "
                    f"{int(plan.row_splits[r + 1])}")
  for a in range(0, plan.num_pieces, _BLOCK):
    doc = np.asarray(plan.doc[a:a + _BLOCK], dtype=np.int64)
    start = np.asarray(plan.start[a:a + _BLOCK], dtype=np.int64)
    length = np.asarray(plan.length[a:a + _BLOCK], dtype=np.int64)
    bad = (doc < 0) | (doc >= len(lengths)) | (start < 0) | (length < 1) | (length > plan.seq_len)
    if not bad.any():
      virtual = np.asarray(lengths, dtype=np.int64)[doc] + plan.extra_tokens
      bad = start + length > virtual
    if bad.any():
      i = int(np.argmax(bad))
      raise PlanError(
          f"{path!r}: piece {a + i} (doc={int(doc[i])}, start={int(start[i])}, "
          f"length={int(length[i])}) does not fit {len(lengths)} documents of seq_len "
          f"{plan.seq_len} (extra_tokens {plan.extra_tokens})")
  occupied = plan.row_lengths()
  if occupied.size and int(occupied.max()) > plan.seq_len:
    r = int(np.argmax(occupied > plan.seq_len))
    raise PlanError(f"{path!r}: row {r} holds {int(occupied[r])} slots, more than seq_len "
                    f"{plan.seq_len}")


def _replace_dir(tmp: str, path: str) -> None:
  """Moves directory `tmp` to `path`, replacing an existing `path` without a partial state."""
  try:
    os.replace(tmp, path)
    return
  except OSError:
    if not os.path.isdir(path):
      raise
  trash = tempfile.mkdtemp(prefix=".old-plan-", dir=os.path.dirname(os.path.abspath(path)))
  os.replace(path, os.path.join(trash, "old"))
  os.replace(tmp, path)
  shutil.rmtree(trash, ignore_errors=True)


def _pickle_array(array: np.ndarray) -> Any:
  if (isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap) and array.filename
      and array.flags.c_contiguous):
    return ("memmap", array.filename, array.dtype.str, array.shape, array.offset)
  return np.asarray(array)


def _unpickle_array(value: Any) -> np.ndarray:
  if isinstance(value, tuple) and value[0] == "memmap":
    _, filename, dtype, shape, offset = value
    if not int(np.prod(shape)):
      return np.zeros(shape, dtype=dtype)
    return np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=shape)
  return value


def _restore_plan(seq_len, overlap, extra_tokens, strategy, stats, row_splits, doc, start,
                  length) -> Plan:
  return Plan(seq_len=seq_len, overlap=overlap, extra_tokens=extra_tokens, strategy=strategy,
              row_splits=_unpickle_array(row_splits), doc=_unpickle_array(doc),
              start=_unpickle_array(start), length=_unpickle_array(length), stats=stats)


def _check_dtypes(plan: Plan, path: str) -> None:
  """Refuses arrays of other dtypes than `Plan` documents (e.g. int64 `doc`, int32 `length` of
  plans written before those dtypes were fixed)."""
  want = {"row_splits": (np.int64,), "doc": (np.int32, np.int64), "start": (np.int32,),
          "length": (np.uint16,) if plan.seq_len <= 65535 else (np.int32,)}
  if plan.doc.dtype == np.int64 and (plan.doc.size == 0 or int(plan.doc.max()) < 2**31 - 1):
    want["doc"] = (np.int32,)  # int64 only when the indices need it
  for name, dtypes in want.items():
    got = getattr(plan, name).dtype
    if got not in [np.dtype(d) for d in dtypes]:
      expected = " or ".join(np.dtype(d).name for d in dtypes)
      raise PlanError(f"{path!r}: {name} is {got}, expected {expected}: a plan of another "
                      "format; plan again")

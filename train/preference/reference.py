"""Reference log-probs, computed once and kept: `WORKDIR/reference` (or `train.preference.score`'s output).

DPO and IPO compare the policy's log-probs with a frozen reference's. segpack scores every pair
with the reference once (`scoring.score_pairs`), before the first step, and stores the table
beside the run; every batch then carries its pairs' reference values (`ref_chosen_logp`,
`ref_rejected_logp`), and no step runs the reference model.

A scores directory holds `scores.json` and one `<split>.npy` (float64 `[pairs, 4]`,
`scoring.COLUMNS`) per split; `scores.json` names the reference (`fingerprint`) and, for each
split, the fingerprint of the data it scored, the pair count and the file's SHA-256. A run
reads it back only when both fingerprints match: resuming with another reference model or
other data is refused in one line, never silently mixed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from segpack import files
from segpack.data import pairs as pairs_lib
from segpack.errors import UserError
from train.preference import scoring

__all__ = ["DIRNAME", "ReferenceError", "load_scores", "model_fingerprint", "save_scores"]

DIRNAME = "reference"
MANIFEST = "scores.json"
VERSION = 1


class ReferenceError(UserError, ValueError):
  """Stored reference scores that do not match the run (model or data), or cannot be read."""


def model_fingerprint(config: Any) -> str:
  """What the reference model is: `model.init_from`'s files (names, sizes, modification times
  and `config.json`), or the seed and model keys of a fresh initialisation."""
  h = hashlib.sha256()
  if config.model.init_from is not None:
    root = Path(config.model.init_from)
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.json")):
      st = path.stat()
      h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update((root / "config.json").read_bytes() if (root / "config.json").exists() else b"")
    return f"init_from:{h.hexdigest()[:16]}"
  h.update(json.dumps(json.loads(config.model.to_json()), sort_keys=True).encode())
  return f"seed{int(config.train.seed)}:{h.hexdigest()[:16]}"


def save_scores(directory: str | os.PathLike[str], *, fingerprint: str,
                tables: dict[str, np.ndarray], data: dict[str, str]) -> None:
  """Writes `tables` (by split) and their manifest atomically, the manifest last."""
  root = Path(directory)
  root.mkdir(parents=True, exist_ok=True)
  splits = {}
  for name, table in tables.items():
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(table, np.float64))
    payload = buffer.getvalue()
    files.atomic_write_bytes(root / f"{name}.npy", payload)
    splits[name] = dict(data=data[name], pairs=int(len(table)), file=f"{name}.npy",
                        sha256=hashlib.sha256(payload).hexdigest())
  files.atomic_write_json(root / MANIFEST, dict(version=VERSION, fingerprint=fingerprint,
                                                columns=list(scoring.COLUMNS), splits=splits))


def read_manifest(directory: str | os.PathLike[str], *, name: str) -> dict[str, Any] | None:
  """The manifest of a scores directory (None when it has none)."""
  path = Path(directory) / MANIFEST
  if not path.exists():
    return None
  try:
    manifest = json.loads(path.read_text("utf-8"))
    if manifest.get("version") != VERSION or not isinstance(manifest.get("splits"), dict):
      raise ValueError(f"version {manifest.get('version')!r}")
  except (OSError, ValueError, AttributeError) as e:
    raise ReferenceError(f"{name}: {path} cannot be read as reference scores: {e}") from e
  return manifest


def _table(root: Path, entry: Any, *, name: str) -> np.ndarray:
  """A split's table, checked: its manifest entry, its bytes' SHA-256, its shape."""
  if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str)
                                            for k in ("file", "sha256")):
    raise ReferenceError(f"{name}: a split of {root / MANIFEST} names no 'file' and 'sha256' "
                         f"(got {entry!r:.120}); delete {root} to score again")
  path = root / entry["file"]
  try:
    payload = path.read_bytes()
  except OSError as e:
    raise ReferenceError(f"{name}: {path} cannot be read: {e}") from e
  if hashlib.sha256(payload).hexdigest() != entry["sha256"]:
    raise ReferenceError(f"{name}: {path} does not match the SHA-256 in its {MANIFEST} (a "
                         f"damaged or replaced file); delete {root} to score again")
  try:
    table = np.load(io.BytesIO(payload), allow_pickle=False)
  except ValueError as e:
    raise ReferenceError(f"{name}: {path} is not a NumPy table: {e}") from e
  want = len(scoring.COLUMNS)
  if table.ndim != 2 or table.shape[1] != want or not np.issubdtype(table.dtype, np.floating):
    raise ReferenceError(f"{name}: {path} holds a {table.dtype} table of shape {table.shape}, "
                         f"not [pairs, {want}] floats ({', '.join(scoring.COLUMNS)}); delete "
                         f"{root} to score again")
  check_finite(table, name=name, where=str(path))
  return table


def check_finite(table: np.ndarray, *, name: str, where: str) -> None:
  """Refuses a table with a NaN or infinite score, naming its first pair: a reference that
  gives one would make every loss of that pair non-finite (and the run stop as if the learning
  rate were too high)."""
  bad = np.flatnonzero(~np.isfinite(table).all(axis=1))
  if bad.size:
    k = int(bad[0])
    raise ReferenceError(
        f"{name}: {where} holds non-finite reference scores ({bad.size} pair(s); pair {k}: "
        f"{table[k].tolist()}): the reference model gives NaN or infinite log-probs there; "
        f"check that model, or score with another")


def load_scores(directory: str | os.PathLike[str], *, name: str, fingerprint: str | None,
                data: dict[str, str], parents: dict[str, tuple[str, np.ndarray]],
                ) -> dict[str, np.ndarray] | None:
  """The tables of `data`'s splits from a scores directory (None when it holds none).

  A split is found by its own data fingerprint, or through its parent dataset's
  (`parents[split] = (fingerprint, parent pair index of each of the split's pairs)`, for
  `train.preference.score`'s scores of a whole dataset).

  Raises:
    ReferenceError: scores of another reference model (`fingerprint`, None: any), or of other
      data, naming `name` (how the run calls the directory) and both fingerprints.
  """
  root = Path(directory)
  manifest = read_manifest(root, name=name)
  if manifest is None:
    return None
  if fingerprint is not None and manifest.get("fingerprint") != fingerprint:
    raise ReferenceError(
        f"{name}: the stored reference scores in {root} are of model "
        f"{manifest.get('fingerprint')!r}, this run's reference is {fingerprint!r}; delete "
        f"{root} to score again with this run's reference, or start a new workdir")
  by_data = {e.get("data"): e for e in manifest["splits"].values() if isinstance(e, dict)}
  out = {}
  for split, fp in data.items():
    if fp in by_data:
      out[split] = _table(root, by_data[fp], name=name)
      continue
    parent, ids = parents[split]
    if parent not in by_data:
      raise ReferenceError(
          f"{name}: the reference scores in {root} are of data {sorted(by_data)}, not of the "
          f"{split} pairs ({fp}, from dataset {parent}); score this dataset (`python -m "
          f"train.preference.score`) or delete {root} to score again")
    table = _table(root, by_data[parent], name=name)
    if len(ids) and int(np.max(ids)) >= len(table):
      raise ReferenceError(
          f"{name}: the scores of dataset {parent} in {root} hold {len(table)} pairs, the "
          f"{split} pairs reach pair {int(np.max(ids))}; score the dataset again")
    out[split] = table[ids]
  return out


def prepare(config: Any, workdir: str, splits: Any, *, step: Any, params: Any, mesh: Any,
            resumed: bool) -> str:
  """Gives every split's rows their reference scores; returns the line the run prints.

  With `preference.reference="init"`: read `WORKDIR/reference` when it holds this reference's
  scores of this data; else, at a fresh start, score the pairs with `params` (the initial
  weights) and keep them there. A resumed run without them is refused (its initial weights
  are gone). With a directory: read `train.preference.score`'s scores from it.

  Raises:
    ReferenceError: scores of another model or data, none for a resumed run, or a count of
      pairs that is not the split's.
  """
  ref = config.preference.reference
  init = ref == "init"
  root = Path(workdir) / DIRNAME if init else Path(ref)
  name = f"preference.reference={ref!r}"
  tables = load_scores(root, name=name, fingerprint=model_fingerprint(config) if init else None,
                       data=splits.fingerprints, parents=splits.parents)
  if tables is None and not init:
    raise ReferenceError(f"{name}: {root} holds no {MANIFEST}; write it with `python -m "
                         f"train.preference.score --model DIR --data DATASET --output {root}`")
  if tables is None and resumed:
    raise ReferenceError(f"{name}: the run in {workdir} resumes, but {root} holds no reference "
                         f"scores (the initial weights that would give them are gone); start "
                         f"a new workdir")
  line = f"reference: read from {root}"
  if tables is None:
    tables = {s: scoring.score_pairs(step=step, params=params, rows=rows, mesh=mesh,
                                     batch_size=config.train.batch_size,
                                     num_pairs=splits.num_pairs[s])[0]
              for s, rows in splits.once.items()}
    for split, table in tables.items():
      check_finite(table, name=name, where=f"the initial weights' scores of the {split} pairs")
    if jax.process_index() == 0:
      save_scores(root, fingerprint=model_fingerprint(config), tables=tables,
                  data=splits.fingerprints)
    line = (f"reference: the initial weights scored "
            f"{sum(len(t) for t in tables.values()):,} pairs once, kept in {root}")
  for split, rows in splits.rows.items():
    table = tables[split]
    if len(table) != splits.num_pairs[split]:
      raise ReferenceError(f"{name}: {len(table)} scores for the {splits.num_pairs[split]} "
                           f"{split} pairs")
    pairs_lib.pair_builder(rows).set_reference(table[:, :2])
  return line

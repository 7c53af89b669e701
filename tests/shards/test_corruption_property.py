"""Property: one damaged byte anywhere is never a silently different result.

Seeded cases corrupt one random byte (XOR with a random non-zero value) of one random file of
(a) a small tokenized dataset (`segpack tokenize` output: manifest, shard token and offsets files,
the trained SentencePiece model and its record, the lock file) and (b) the same dataset's plan
cache after `pack_dataset` cached its plan. After each corruption the readers run on a fresh copy:
`ShardSource` + `pack_dataset` (every row of one epoch), and for (a) also `segpack stats --json`.
Each reader must end in one of:

- `refused`: an error of the project's own (`segpack.errors.is_user_error`) naming the
  damaged file (for the manifest: an error about the manifest, also one naming the shard file
  whose recorded size or checksum no longer matches);
- `recomputed`: a warning naming the plan cache directory, and the intact result (plan cache);
- `identical`: the same rows (every array) and statistics as the intact copy.

A different result without an error fails the test. The counts per outcome are printed
(`pytest -s`) and each kind must see at least two outcomes.
"""

import collections
import contextlib
import io
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from segpack import shards
from segpack import errors
from segpack.cli import main as cli_main
from segpack.data.packed import pack_dataset
from segpack.text import dataset as dataset_lib

SEED = 20261124
CASES = {"dataset": 250, "plans": 80}
SEQ_LEN = 64


def _rows(path: Path) -> list[dict[str, np.ndarray]]:
  """Every row of one unshuffled epoch of `pack_dataset` over the dataset at `path`."""
  rows = pack_dataset(shards.ShardSource(path), seq_len=SEQ_LEN, shuffle=False, num_epochs=1)
  return [{k: np.array(v) for k, v in rows[i].items()} for i in range(len(rows))]


def _same_rows(a, b) -> bool:
  return len(a) == len(b) and all(
      x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def _stats(path: Path) -> dict | str:
  """`segpack stats --json` (without its timing), or its one error line."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli_main.main(["stats", "--data", str(path), "--seq-len", str(SEQ_LEN), "--json"])
  if rc != 0:
    lines = err.getvalue().strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, lines)
    return lines[0]
  stats = json.loads(out.getvalue())
  stats.pop("plan_seconds")
  return stats


def _names(message: str, damaged: Path) -> bool:
  if damaged.name in message:
    return True
  return damaged.name == shards.MANIFEST_NAME and "manifest" in message


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
  """(dataset directory with its plan cached, intact rows, intact statistics)."""
  root = tmp_path_factory.mktemp("corruption")
  text = root / "in.txt"
  text.write_text("\n\n".join(f"document {j}: some words, and more words {j * j} about things"
                              for j in range(300)))
  out = root / "data"
  dataset_lib.tokenize_files([text], out, vocab_size=300, workers=1, shard_tokens=1500,
                             doc_separator="blank-line")
  rows = _rows(out)  # also caches the plan in out/plans
  assert len(list((out / "plans").rglob("*.npy"))) >= 3
  return out, rows, _stats(out)


@pytest.fixture(autouse=True)
def _own_verification_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("SEGPACK_CACHE", str(tmp_path / "cache"))


def _corrupt(rng: np.random.Generator, files: list[Path]) -> tuple[Path, int]:
  """Damages one byte of one of `files` (the manifest, when listed, half of the time: its bytes
  mean the most different things); returns the file and the byte's position."""
  manifest = [p for p in files if p.name == shards.MANIFEST_NAME]
  if manifest and rng.random() < 0.5:
    target = manifest[0]
  else:
    target = files[int(rng.integers(len(files)))]
  data = bytearray(target.read_bytes())
  pos = int(rng.integers(len(data)))
  data[pos] ^= int(rng.integers(1, 256))
  target.write_bytes(bytes(data))
  return target, pos


def _read_rows(path: Path, damaged: Path, want_rows) -> str:
  """The outcome of `pack_dataset` over `path` (see the module docstring)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      rows = _rows(path)
    except Exception as e:  # pylint: disable=broad-except
      assert errors.is_user_error(e) and _names(str(e), damaged), (damaged, repr(e))
      return "refused"
  assert _same_rows(rows, want_rows), f"{damaged}: silently different rows"
  plan_warnings = [w for w in caught if "plan cache" in str(w.message)]
  if plan_warnings:
    assert any(damaged.parent.name in str(w.message) for w in plan_warnings), plan_warnings
    return "recomputed"
  return "identical"


def _run_kind(kind: str, intact, tmp_path: Path) -> collections.Counter:
  source, want_rows, want_stats = intact
  rng = np.random.default_rng([SEED, kind == "plans"])
  counts = collections.Counter()
  for case in range(CASES[kind]):
    copy = tmp_path / f"case{case}"
    shutil.copytree(source, copy, ignore=None if kind == "plans" else shutil.ignore_patterns(
        "plans"))
    pool = sorted(p for p in (copy / "plans" if kind == "plans" else copy).rglob("*")
                  if p.is_file() and p.stat().st_size and (kind == "plans" or "plans" not in
                                                           p.relative_to(copy).parts))
    damaged, pos = _corrupt(rng, pool)
    outcome = _read_rows(copy, damaged, want_rows)
    counts[f"pack_dataset {outcome}"] += 1
    if kind == "dataset":
      stats = _stats(copy)
      if isinstance(stats, str):
        assert _names(stats, damaged), (damaged, pos, stats)
        counts["stats refused"] += 1
      else:
        assert stats == want_stats, f"{damaged} byte {pos}: silently different statistics"
        counts["stats identical"] += 1
    shutil.rmtree(copy)
  print(f"\n{kind}: {CASES[kind]} cases: {dict(sorted(counts.items()))}")
  return counts


def test_a_damaged_byte_in_a_dataset_is_refused_by_name_or_harmless(intact, tmp_path):
  counts = _run_kind("dataset", intact, tmp_path)
  assert counts["pack_dataset refused"] >= 2 and counts["pack_dataset identical"] >= 2, counts
  assert counts["pack_dataset recomputed"] == 0, counts  # no plan cache in these copies


def test_a_damaged_byte_in_a_plan_cache_is_replanned_with_a_warning(intact, tmp_path):
  counts = _run_kind("plans", intact, tmp_path)
  assert counts["pack_dataset recomputed"] >= CASES["plans"] // 2, counts

"""`train.preference.reference.load_scores` on damaged scores directories: a split entry without
its file, a table of the wrong shape whose SHA-256 matches the manifest, a parent table shorter
than the pairs it must give, a NaN or infinite score, each refused in one `ReferenceError` naming
the directory (before: a KeyError, an IndexError, a table of the wrong shape used as scores, or
a non-finite loss blamed on the learning rate)."""

import hashlib
import io
import json

import numpy as np
import pytest

from train.preference import reference as reference_lib


def _scores(tmp_path, table=None):
  table = np.arange(12, dtype=np.float64).reshape(3, 4) if table is None else table
  reference_lib.save_scores(tmp_path, fingerprint="m", tables={"dataset": table},
                            data={"dataset": "d1"})
  return tmp_path


def _load(root, **kwargs):
  return reference_lib.load_scores(root, name="preference.reference", fingerprint="m",
                                   **{"data": {"train": "d1"}, "parents": {}, **kwargs})


def _rewrite(root, edit):
  manifest = json.loads((root / reference_lib.MANIFEST).read_text())
  edit(manifest["splits"]["dataset"])
  (root / reference_lib.MANIFEST).write_text(json.dumps(manifest))


def test_intact_scores_load_as_written(tmp_path):
  got = _load(_scores(tmp_path))
  np.testing.assert_array_equal(got["train"], np.arange(12).reshape(3, 4))


def test_a_split_entry_without_its_file_is_one_line(tmp_path):
  root = _scores(tmp_path)
  _rewrite(root, lambda e: e.pop("file"))
  with pytest.raises(reference_lib.ReferenceError, match="names no 'file' and 'sha256'"):
    _load(root)


def test_a_table_of_the_wrong_shape_with_a_matching_digest_is_refused(tmp_path):
  root = _scores(tmp_path)
  buffer = io.BytesIO()
  np.save(buffer, np.arange(5, dtype=np.float64))
  (root / "dataset.npy").write_bytes(buffer.getvalue())
  _rewrite(root, lambda e: e.update(sha256=hashlib.sha256(buffer.getvalue()).hexdigest()))
  with pytest.raises(reference_lib.ReferenceError, match=r"shape \(5,\), not \[pairs, 4\]"):
    _load(root)


def test_a_parent_table_shorter_than_the_pairs_it_gives_is_refused(tmp_path):
  root = _scores(tmp_path)
  parents = {"train": ("d1", np.array([0, 2]))}
  got = _load(root, data={"train": "other"}, parents=parents)  # through its parent: fine
  np.testing.assert_array_equal(got["train"], np.arange(12).reshape(3, 4)[[0, 2]])
  with pytest.raises(reference_lib.ReferenceError, match="hold 3 pairs, the train pairs reach "
                                                         "pair 7"):
    _load(root, data={"train": "other"}, parents={"train": ("d1", np.array([1, 7]))})


def test_non_finite_scores_are_refused_naming_the_pair(tmp_path):
  """Before: read as they were, and the run stopped at step 1 asking for a lower learning rate."""
  table = np.arange(12, dtype=np.float64).reshape(3, 4)
  table[1, 0] = np.nan
  with pytest.raises(reference_lib.ReferenceError,
                     match=r"holds non-finite reference scores \(1 pair\(s\); pair 1: \[nan"):
    _load(_scores(tmp_path, table))
  table[1, 0] = -np.inf
  with pytest.raises(reference_lib.ReferenceError, match="pair 1: \\[-inf"):
    _load(_scores(tmp_path / "inf", table))

"""Corrupt shards and plans are refused or recomputed before they reach a model."""

import json
import os
import warnings

import numpy as np
import pytest

from segpack import files, packing
from segpack.shards import ShardFormatError, ShardSource, ShardWriter
from segpack.shards import verified


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("SEGPACK_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def dataset(tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "ds"
  with ShardWriter(path, vocab_size=1000, tokenizer_fingerprint="sha256:test",
                   shard_tokens=200) as w:
    for _ in range(40):
      w.write(rng.integers(0, 1000, size=int(rng.integers(1, 30))))
  return path


def _edit_manifest(path, fn):
  m = json.loads((path / "manifest.json").read_text())
  fn(m)
  (path / "manifest.json").write_text(json.dumps(m))


def _flip(path, pos=4, data=b"\x01\x00"):
  with open(path, "r+b") as f:
    f.seek(pos)
    old = f.read(len(data))
    f.seek(pos)
    f.write(bytes(a ^ b for a, b in zip(old, data)))


def _count_hashes(monkeypatch):
  calls = []
  real = files.sha256_file
  def counting(p):
    calls.append(str(p))
    return real(p)
  monkeypatch.setattr(files, "sha256_file", counting)
  return calls


def test_manifest_records_the_largest_token_id(dataset):
  src = ShardSource(dataset)
  for s in src.manifest["shards"]:
    mm = np.fromfile(dataset / s["tokens"], "<u2")
    assert s["max_token"] == int(mm.max())


def test_flipped_token_byte_is_refused_at_open(dataset):
  tokens = dataset / "shard-00001.tokens"
  _flip(tokens)
  with pytest.raises(ShardFormatError, match=f"{tokens}: checksum mismatch: sha256 [0-9a-f]{{64}} "
                     f"but the manifest says [0-9a-f]{{64}}"):
    ShardSource(dataset)
  ShardSource(dataset, verify="never")  # the structural checks alone cannot see it


def test_flipped_byte_with_restored_mtime_is_caught_after_a_cached_open(dataset):
  ShardSource(dataset)  # verified and remembered
  tokens = dataset / "shard-00001.tokens"
  st = os.stat(tokens)
  _flip(tokens)
  os.utime(tokens, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert os.stat(tokens).st_mtime_ns == st.st_mtime_ns and os.stat(tokens).st_ino == st.st_ino
  with pytest.raises(ShardFormatError, match="shard-00001.tokens: checksum mismatch"):
    ShardSource(dataset)  # ctime_ns, part of the key, changed with the write and the utime


def test_flipped_byte_is_not_caught_when_the_whole_key_is_unchanged(dataset, monkeypatch):
  # The documented limit: a change that leaves (size, mtime, ctime, inode, device) as they were
  # (which needs a clock reset or a raw device write) is not seen by a cached open.
  ShardSource(dataset)
  tokens = dataset / "shard-00001.tokens"
  key = verified.file_key(tokens)
  _flip(tokens)
  real = verified.file_key
  monkeypatch.setattr(verified, "file_key", lambda p: key if str(p) == str(tokens) else real(p))
  ShardSource(dataset)
  with pytest.raises(ShardFormatError, match="checksum mismatch"):
    ShardSource(dataset, verify="always")


def test_vocab_size_below_the_stored_ids_is_refused(dataset):
  top = max(s["max_token"] for s in ShardSource(dataset).manifest["shards"])
  _edit_manifest(dataset, lambda m: m.update(vocab_size=top))
  with pytest.raises(ShardFormatError, match=f"largest token id {top} .* >= vocab_size {top}"):
    ShardSource(dataset, verify="never")


def test_vocab_size_below_the_ids_without_max_token_is_refused(dataset, monkeypatch):
  def older(m):  # a manifest of a writer that did not record max_token
    for s in m["shards"]:
      del s["max_token"]
  _edit_manifest(dataset, older)
  calls = _count_hashes(monkeypatch)
  ShardSource(dataset)  # hashed and scanned; the largest ids are remembered
  _edit_manifest(dataset, lambda m: m.update(vocab_size=500))
  n = len(calls)
  with pytest.raises(ShardFormatError, match="largest token id .* \\(found when the file was "
                     "verified\\) is >= vocab_size 500"):
    ShardSource(dataset)  # cached: no hash, the remembered maximum is checked
  assert len(calls) == n
  with pytest.raises(ShardFormatError, match="token id .* at position .* >= vocab_size 500"):
    ShardSource(dataset, verify="always")  # scanned


def test_shifted_offset_is_refused(dataset):
  offsets = dataset / "shard-00000.offsets"
  o = np.fromfile(offsets, "<i8")
  o[2] += 1  # still increasing and in range: only the checksum sees it
  o.tofile(offsets)
  with pytest.raises(ShardFormatError, match=f"{offsets}: checksum mismatch"):
    ShardSource(dataset)
  o[1:] = o[:-1].copy()  # every entry shifted by one place
  o.tofile(offsets)
  with pytest.raises(ShardFormatError, match=f"{offsets}: "):
    ShardSource(dataset, verify="never")


def test_truncated_token_file_is_refused_at_open(dataset):
  tokens = dataset / "shard-00000.tokens"
  size = tokens.stat().st_size
  os.truncate(tokens, size - 2)
  with pytest.raises(ShardFormatError, match=f"{tokens}: token file is {size - 2} bytes"):
    ShardSource(dataset, verify="never")


def test_verification_is_remembered_and_invalidated(dataset, monkeypatch):
  calls = _count_hashes(monkeypatch)
  ShardSource(dataset)
  n = len(calls)
  assert n == 2 * len(ShardSource(dataset, verify="never").manifest["shards"])
  ShardSource(dataset)
  assert len(calls) == n  # the second open hashes nothing
  assert (dataset.parent / "cache" / "verified.json").is_file()
  ShardSource(dataset, verify="always")
  assert len(calls) == 2 * n
  tokens = dataset / "shard-00000.tokens"
  tokens.write_bytes(tokens.read_bytes())  # same content, a new modification
  ShardSource(dataset)
  assert calls[2 * n:] == [str(tokens)]


def test_verify_argument_is_checked(dataset):
  with pytest.raises(ValueError, match="verify must be one of .* got 'sometimes'"):
    ShardSource(dataset, verify="sometimes")


def _cached_plan(tmp_path, lengths):
  plan = packing.load_or_plan(lengths, 32, cache_dir=tmp_path / "plans", key="k",
                              extra_tokens=2)
  (d,) = [p for p in (tmp_path / "plans").iterdir() if not p.name.startswith(".")]
  return plan, d


def _rows(plan):
  return [plan.row(r) for r in range(plan.num_rows)]


@pytest.mark.parametrize("name", ["doc", "length"])
def test_edited_plan_array_is_recomputed(tmp_path, name):
  lengths = np.random.default_rng(1).integers(1, 40, size=50)
  fresh = packing.plan(lengths, 32, extra_tokens=2)
  _, d = _cached_plan(tmp_path, lengths)
  a = np.load(d / f"{name}.npy")
  a[0], a[1] = a[1], int(a[0]) - (0 if name == "doc" else 1)  # still in range
  np.save(d / f"{name}.npy", a)
  with pytest.warns(UserWarning, match=f"plan cache {d} is damaged or stale .*{name}.npy"):
    plan, _ = _cached_plan(tmp_path, lengths)
  assert _rows(plan) == _rows(fresh)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _rows(_cached_plan(tmp_path, lengths)[0]) == _rows(fresh)  # replaced for good


def test_out_of_range_doc_is_recomputed_without_index_error(tmp_path):
  lengths = np.random.default_rng(2).integers(1, 40, size=30)
  fresh = packing.plan(lengths, 32, extra_tokens=2)
  _, d = _cached_plan(tmp_path, lengths)
  a = np.load(d / "doc.npy")
  a[3] = 10**6
  np.save(d / "doc.npy", a)
  sums = json.loads((d / "sha256.json").read_text())
  sums["doc.npy"] = files.sha256_file(d / "doc.npy")  # a consistent but wrong plan
  (d / "sha256.json").write_text(json.dumps(sums))
  with pytest.warns(UserWarning, match=f"plan cache {d} .*piece 3 \\(doc=1000000"):
    plan, _ = _cached_plan(tmp_path, lengths)
  assert _rows(plan) == _rows(fresh)


def test_plan_without_checksums_is_recomputed(tmp_path):
  lengths = np.arange(1, 20)
  _, d = _cached_plan(tmp_path, lengths)
  (d / "sha256.json").unlink()
  with pytest.warns(UserWarning, match="sha256.json' is missing"):
    _cached_plan(tmp_path, lengths)
  assert (d / "sha256.json").is_file()

"""Tests for segpack.shards: the writer, the reader and every structural error."""

import concurrent.futures
import hashlib
import json
import multiprocessing
import pickle

import grain
import numpy as np
import pytest

from segpack import shards
from segpack.shards import ShardFormatError, ShardSource, ShardWriter


def _random_docs(n, vocab, *, seed=0, max_len=40, empty_every=7):
  rng = np.random.default_rng(seed)
  docs = []
  for i in range(n):
    length = 0 if i % empty_every == 3 else int(rng.integers(1, max_len))
    docs.append(rng.integers(0, vocab, size=length))
  return docs


def _write(path, docs, *, vocab=1000, shard_tokens=100, **kw):
  with ShardWriter(path, vocab_size=vocab, tokenizer_fingerprint="sha256:test",
                   shard_tokens=shard_tokens, **kw) as w:
    for d in docs:
      w.write(d)
  return w


def _killed_write(path, docs, *, tokenizer_fingerprint="sha256:test", **kw):
  """Writes `docs` with a `ShardWriter` (vocabulary 1000, 100-token shards) that an exception
  then interrupts, as in a killed run."""
  with pytest.raises(RuntimeError, match="killed"):
    with ShardWriter(path, vocab_size=1000, tokenizer_fingerprint=tokenizer_fingerprint,
                     shard_tokens=100, **kw) as w:
      for d in docs:
        w.write(d)
      raise RuntimeError("killed")


@pytest.fixture
def dataset(tmp_path):
  docs = _random_docs(60, 1000)
  _write(tmp_path / "ds", docs)
  return tmp_path / "ds", [d for d in docs if d.size]


def test_round_trip_matches_the_documents_written(dataset):
  path, docs = dataset
  src = ShardSource(path)
  assert len(src) == len(docs)
  assert src.num_shards > 1
  np.testing.assert_array_equal(src.lengths, [d.size for d in docs])
  assert src.lengths.dtype == np.int64
  assert src.num_tokens == sum(d.size for d in docs)
  for i, d in enumerate(docs):
    np.testing.assert_array_equal(src[i], d)
    assert src[i].dtype == np.uint16
  manifest = json.loads((path / "manifest.json").read_text())
  assert manifest["skipped_empty"] == 60 - len(docs)
  assert manifest["num_documents"] == len(docs)


def test_docstring_example_shard_layout(tmp_path):
  _write(tmp_path, [[5, 6, 7], [], [8, 9], [1]], vocab=10, shard_tokens=4)
  assert np.fromfile(tmp_path / "shard-00000.tokens", "<u2").tolist() == [5, 6, 7, 8, 9]
  assert np.fromfile(tmp_path / "shard-00000.offsets", "<i8").tolist() == [0, 3, 5]
  assert np.fromfile(tmp_path / "shard-00001.tokens", "<u2").tolist() == [1]
  assert np.fromfile(tmp_path / "shard-00001.offsets", "<i8").tolist() == [0, 1]
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "manifest.json", "shard-00000.offsets", "shard-00000.tokens", "shard-00001.offsets",
      "shard-00001.tokens"]


def test_views_are_read_only_zero_copy_and_accept_numpy_indices(dataset):
  path, docs = dataset
  src = ShardSource(path)
  view = src[np.int64(5)]
  assert type(view) is np.ndarray
  assert not view.flags.writeable and not view.flags.owndata
  with pytest.raises(ValueError):
    view[0] = 1
  np.testing.assert_array_equal(src[-1], docs[-1])
  np.testing.assert_array_equal(src[np.uint32(2)], docs[2])
  with pytest.raises(IndexError, match=str(len(docs))):
    src[len(docs)]
  with pytest.raises(TypeError, match="1.5"):
    src[1.5]


def test_is_a_grain_source_and_pickles_without_token_data(dataset):
  path, docs = dataset
  src = ShardSource(path)
  assert isinstance(src, grain.sources.RandomAccessDataSource)
  src[0]  # Opens the memmaps; they must not travel.
  blob = pickle.dumps(src)
  assert len(blob) < 4096
  clone = pickle.loads(blob)
  np.testing.assert_array_equal(clone.lengths, src.lengths)
  np.testing.assert_array_equal(clone[7], docs[7])
  assert clone.fingerprint == src.fingerprint
  ds = grain.MapDataset.source(src).map(lambda x: int(x.sum()))
  assert [ds[i] for i in range(len(docs))] == [int(d.sum()) for d in docs]


def _sum_in_worker(args):
  src, index = args
  opened_before = src._tokens is not None
  return opened_before, int(src[index].astype(np.int64).sum())


def test_reads_in_spawned_worker_processes(dataset):
  path, docs = dataset
  src = ShardSource(path)
  src[0]
  ctx = multiprocessing.get_context("spawn")
  with ctx.Pool(2) as pool:
    got = pool.map(_sum_in_worker, [(src, i) for i in range(0, len(docs), 4)], chunksize=1)
  assert not any(opened for opened, _ in got)  # Each copy opened its own memmaps.
  assert [s for _, s in got] == [int(d.sum()) for d in docs[::4]]


def test_concurrent_reads_from_threads(dataset):
  path, docs = dataset
  src = ShardSource(path)  # Memmaps not opened yet: the first reads race to open them.
  order = np.random.default_rng(1).permutation(len(docs) * 20) % len(docs)
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    got = list(pool.map(lambda i: src[i].copy(), order))
  for i, g in zip(order, got):
    np.testing.assert_array_equal(g, docs[i])


def test_large_vocabulary_uses_uint32(tmp_path):
  docs = [np.array([70000, 3, 65536]), np.array([1])]
  _write(tmp_path, docs, vocab=100_000)
  src = ShardSource(tmp_path)
  assert src.dtype == np.dtype("<u4") and src[0].dtype == np.uint32
  np.testing.assert_array_equal(src[0], docs[0])
  assert (tmp_path / "shard-00000.tokens").stat().st_size == 4 * 4
  assert shards.dtype_for_vocab(65536) == np.uint16
  assert shards.dtype_for_vocab(65537) == np.uint32


def test_fingerprint_depends_on_content_only(tmp_path):
  docs = _random_docs(30, 1000, seed=3)
  _write(tmp_path / "a", docs)
  _write(tmp_path / "b", docs)
  _write(tmp_path / "c", docs[:-1])
  a, b, c = (ShardSource(tmp_path / x).fingerprint for x in "abc")
  assert a == b != c


def test_empty_dataset(tmp_path):
  _write(tmp_path, [[], []])
  src = ShardSource(tmp_path)
  assert len(src) == 0 and src.lengths.shape == (0,)
  src.verify()


def test_hand_made_empty_shard_is_readable(tmp_path):
  _write(tmp_path, [[1, 2]], vocab=10)
  (tmp_path / "empty.tokens").write_bytes(b"")
  np.zeros(1, "<i8").tofile(tmp_path / "empty.offsets")
  empty_hash = hashlib.sha256(b"").hexdigest()
  zero_hash = hashlib.sha256(bytes(8)).hexdigest()
  _edit_manifest(tmp_path, lambda m: m["shards"].insert(0, {
      "tokens": "empty.tokens", "offsets": "empty.offsets", "num_documents": 0, "num_tokens": 0,
      "sha256": {"tokens": empty_hash, "offsets": zero_hash}}))
  src = ShardSource(tmp_path)
  np.testing.assert_array_equal(src[0], [1, 2])
  src.verify()


def test_writer_rejects_bad_documents(tmp_path):
  with ShardWriter(tmp_path, vocab_size=10, tokenizer_fingerprint="x") as w:
    w.write([1, 2])
    with pytest.raises(ValueError,
                       match=r"document 1 has token id 10 outside \[0, vocab_size=10\)"):
      w.write([3, 10])
    with pytest.raises(ValueError, match="-1"):
      w.write([-1])
    with pytest.raises(TypeError, match="1-D integer"):
      w.write(np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match="float"):
      w.write(np.array([1.0]))
    w.write([4])
  np.testing.assert_array_equal(ShardSource(tmp_path)[1], [4])


# -----------------------------------------------------------------------------------------------
# Interruption and resume.


def test_exception_inside_writer_leaves_no_manifest_and_no_partial_shard(tmp_path):
  docs = _random_docs(40, 1000)
  with pytest.raises(RuntimeError):
    with ShardWriter(tmp_path, vocab_size=1000, tokenizer_fingerprint="x", shard_tokens=100) as w:
      for d in docs[:30]:
        w.write(d)
      assert w._open_shard is not None  # A shard is half written.
      raise RuntimeError("killed")
  names = sorted(p.name for p in tmp_path.iterdir())
  assert "manifest.json" not in names
  assert not [n for n in names if n.endswith(".tmp")]
  with pytest.raises(ShardFormatError, match="missing manifest.*unfinished write"):
    ShardSource(tmp_path)


def test_resume_keeps_finished_shards_and_matches_a_single_run(tmp_path):
  docs = _random_docs(80, 1000, seed=5)
  _write(tmp_path / "ref", docs, resume_key="k")
  _killed_write(tmp_path / "r", docs[:50], resume_key="k")
  finished = sorted(p.name for p in (tmp_path / "r").glob("*.done.json"))
  assert len(finished) >= 2
  w = ShardWriter(tmp_path / "r", vocab_size=1000, tokenizer_fingerprint="sha256:test",
                  shard_tokens=100, resume_key="k")
  assert w.resumed_shards == len(finished)
  assert 0 < w.resumed_inputs < 50
  with w:
    for d in docs[w.resumed_inputs:]:
      w.write(d)
  ref = json.loads((tmp_path / "ref" / "manifest.json").read_text())
  got = json.loads((tmp_path / "r" / "manifest.json").read_text())
  assert got["shards"] == ref["shards"]
  assert got["skipped_empty"] == ref["skipped_empty"]
  assert not list((tmp_path / "r").glob("*.done.json"))
  ShardSource(tmp_path / "r").verify()


def test_resume_with_another_key_or_corrupt_shard_starts_over(tmp_path):
  docs = _random_docs(80, 1000, seed=5)
  _killed_write(tmp_path, docs, tokenizer_fingerprint="x", resume_key="k")
  w = ShardWriter(tmp_path, vocab_size=1000, tokenizer_fingerprint="x", shard_tokens=100,
                  resume_key="other")
  assert w.resumed_shards == 0 and w.resumed_inputs == 0
  assert not list(tmp_path.glob("shard-*"))
  w.abort()
  _killed_write(tmp_path, docs, tokenizer_fingerprint="x", resume_key="k")
  with open(tmp_path / "shard-00001.tokens", "r+b") as f:  # Corrupt the second shard.
    f.write(b"\xff\xff")
  w = ShardWriter(tmp_path, vocab_size=1000, tokenizer_fingerprint="x", shard_tokens=100,
                  resume_key="k")
  assert w.resumed_shards == 1
  assert not (tmp_path / "shard-00002.tokens").exists()
  w.abort()


# -----------------------------------------------------------------------------------------------
# Bad input: each error names the file and the value.


def _edit_manifest(path, fn):
  m = json.loads((path / "manifest.json").read_text())
  fn(m)
  (path / "manifest.json").write_text(json.dumps(m))


def test_missing_directory(tmp_path):
  with pytest.raises(ShardFormatError, match=f"{tmp_path / 'nope'}: dataset directory does not"):
    ShardSource(tmp_path / "nope")


def test_missing_manifest(dataset):
  path, _ = dataset
  (path / "manifest.json").unlink()
  with pytest.raises(ShardFormatError, match=f"{path / 'manifest.json'}: missing manifest"):
    ShardSource(path)


def test_corrupt_manifest(dataset):
  path, _ = dataset
  text = (path / "manifest.json").read_text()
  (path / "manifest.json").write_text(text[: len(text) // 2])
  with pytest.raises(ShardFormatError,
                     match=r"manifest.json: corrupt manifest, invalid JSON at line"):
    ShardSource(path)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(format_version=99), "unsupported format_version 99"),
    (lambda m: m.update(vocab_size="big"), "vocab_size must be an int.*'big'"),
    (lambda m: m.update(dtype="uint32"), "dtype 'uint32' does not match vocab_size 1000"),
    (lambda m: m["shards"][0].pop("sha256"), r"shards\[0\] is malformed"),
    (lambda m: m["shards"][0].update(tokens="../x"), r"shards\[0\] is malformed"),
    (lambda m: m.update(num_documents=1), "num_documents is 1 but the shards sum to"),
])
def test_manifest_fields_are_checked(dataset, edit, message):
  path, _ = dataset
  _edit_manifest(path, edit)
  with pytest.raises(ShardFormatError, match=message):
    ShardSource(path)


def test_truncated_token_file(dataset):
  path, _ = dataset
  tokens = path / "shard-00001.tokens"
  size = tokens.stat().st_size
  with open(tokens, "r+b") as f:
    f.truncate(size - 2)
  with pytest.raises(ShardFormatError,
                     match=f"{tokens}: token file is {size - 2} bytes but the manifest says "
                     f"{size // 2} uint16 tokens .* \\(truncated\\)"):
    ShardSource(path)


def test_token_file_not_matching_manifest(dataset):
  path, _ = dataset
  with open(path / "shard-00000.tokens", "ab") as f:
    f.write(b"\0\0")
  with pytest.raises(ShardFormatError, match="shard-00000.tokens: token file is"):
    ShardSource(path)
  (path / "shard-00002.tokens").unlink()
  with pytest.raises(ShardFormatError, match="shard-00000.tokens"):
    ShardSource(path)


def test_missing_shard_file(dataset):
  path, _ = dataset
  (path / "shard-00001.offsets").unlink()
  with pytest.raises(ShardFormatError, match="shard-00001.offsets: shard file listed in the "
                     "manifest is missing"):
    ShardSource(path)


def _rewrite_offsets(path, fn):
  p = path / "shard-00000.offsets"
  offsets = np.fromfile(p, "<i8")
  fn(offsets)
  offsets.tofile(p)
  return p


def test_decreasing_offsets(dataset):
  path, _ = dataset
  def swap(o):
    o[2] = o[1] - 1
  p = _rewrite_offsets(path, swap)
  with pytest.raises(ShardFormatError, match=f"{p}: offsets decrease at document 1: offsets"):
    ShardSource(path)


def test_offsets_past_the_end(dataset):
  path, _ = dataset
  src = ShardSource(path)
  n = int(src.manifest["shards"][0]["num_tokens"])
  def past(o):
    o[-2] = n + 5
    o[-1] = n + 5
  p = _rewrite_offsets(path, past)
  with pytest.raises(ShardFormatError, match=f"{p}: offsets.*={n + 5} points past the end of the "
                     f"token file \\({n} tokens\\)"):
    ShardSource(path)


def test_verify_finds_token_ids_out_of_vocabulary(tmp_path):
  docs = [np.array([1, 2, 3]), np.array([4, 70, 5]), np.array([6])]
  _write(tmp_path, docs, vocab=100)
  ShardSource(tmp_path).verify()
  def shrink(m):  # Checksums still match; a manifest of an older writer has no max_token.
    m.update(vocab_size=50)
    for shard in m["shards"]:
      del shard["max_token"]
  _edit_manifest(tmp_path, shrink)
  src = ShardSource(tmp_path, verify="never")  # The cheap checks do not read tokens.
  with pytest.raises(ShardFormatError, match="token id 70 at position 4 \\(document 1\\) is >= "
                     "vocab_size 50"):
    src.verify()


def test_verify_finds_checksum_mismatch(dataset):
  path, _ = dataset
  with open(path / "shard-00001.tokens", "r+b") as f:
    f.write(b"\x01\x00")
  src = ShardSource(path, verify="never")  # the default verification would refuse to open
  with pytest.raises(ShardFormatError, match="shard-00001.tokens: checksum mismatch"):
    src.verify()

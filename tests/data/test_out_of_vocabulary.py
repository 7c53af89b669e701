"""Token ids outside the vocabulary (issue "silent round 2", class 3): the cached built-in corpora
go through the checks of every dataset the trainer opens, and ids >= vocab_size are refused
where rows read them, whatever the manifest says.

Oracles: the bytes of a shard saved before it is damaged (a rebuilt cache must equal them), and
ids the test itself writes past the vocabulary (the error must name that file, id and size).
"""

import hashlib
import json
import re
import shutil

import numpy as np
import pytest

import segpack
from segpack import shards
from segpack.text import corpus
from segpack.text.chat import corpus as chat_corpus
from train import data as data_lib

from support import small_corpus
from support import data_configs  # noqa: E402

BAD = 65535  # the largest uint16: far past the small corpora's 2048 ids


@pytest.fixture(autouse=True)
def _own_verification_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("SEGPACK_CACHE", str(tmp_path / "verified"))


def _damage(tokens_path, count=1999, *, rehash=False):
  """Sets `count` token ids of a shard to BAD; with `rehash` the manifest's checksum is made to
  match, so that only the ids themselves are wrong (a damage no checksum can see)."""
  ids = np.fromfile(tokens_path, "<u2")
  ids[100:100 + count] = BAD
  ids.tofile(tokens_path)
  if rehash:
    manifest_path = tokens_path.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for shard in manifest["shards"]:
      if shard["tokens"] == tokens_path.name:
        shard["sha256"]["tokens"] = hashlib.sha256(tokens_path.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def _copied_cache(src, tmp_path):
  dst = tmp_path / "cache"
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.lock"))
  return dst


def spec(**kw):
  return data_configs.builtin_data_config(**{"seq_len": 256, **kw})


def read_every_row(rows):
  for lo in range(0, len(rows), 256):
    rows.get_batch(np.arange(lo, min(lo + 256, len(rows))))


def test_a_damaged_cached_chat_corpus_is_rebuilt(tmp_path_factory, tmp_path):
  shared = tmp_path_factory.getbasetemp() / "segpack-chat-cache"
  built = chat_corpus.ensure_builtin_chat(size="small", cache_dir=shared)
  cache = _copied_cache(shared, tmp_path)
  copy = chat_corpus.ensure_builtin_chat(size="small", cache_dir=cache)
  tokens = copy.train_dir / "shard-00000.tokens"
  intact = tokens.read_bytes()
  assert intact == (built.train_dir / "shard-00000.tokens").read_bytes()
  _damage(tokens)
  again = chat_corpus.ensure_builtin_chat(size="small", cache_dir=cache)
  assert tokens.read_bytes() == intact
  shards.ShardSource(again.train_dir).verify()


def test_a_damaged_cached_corpus_is_rebuilt_and_says_why(tmp_path_factory, tmp_path, caplog):
  cache = _copied_cache(small_corpus.cache_dir(tmp_path_factory), tmp_path)
  built = corpus.ensure_builtin(size="small", cache_dir=cache, workers=1)
  tokens = built.train_dir / "shard-00000.tokens"
  intact = tokens.read_bytes()
  _damage(tokens)
  corpus.ensure_builtin(size="small", cache_dir=cache, workers=1)
  assert tokens.read_bytes() == intact
  assert f"{tokens}: checksum mismatch" in caplog.text


def test_ids_past_the_vocabulary_in_the_cached_corpus_stop_the_trainer(tmp_path_factory,
                                                                       tmp_path):
  cache = _copied_cache(small_corpus.cache_dir(tmp_path_factory), tmp_path)
  built = corpus.ensure_builtin(size="small", cache_dir=cache, workers=1)
  tokens = built.train_dir / "shard-00000.tokens"
  _damage(tokens, rehash=True)  # checksums match: only the ids are wrong
  data = data_lib.make_data(spec(cache_dir=str(cache)), batch_size=8, process_index=0,
                            process_count=1)
  with pytest.raises(shards.ShardFormatError) as e:
    for k in range(data.train_rows_in_epoch0 // 8 + 1):
      data.train[k]
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith(f"{tokens}: token id {BAD} at position ")
  assert "is >= vocab_size 2048" in message


@pytest.fixture(name="dataset")
def dataset_with_a_lowered_vocabulary(tmp_path):
  """A dataset of ids in [3, 2048), opened (verified) once; then its manifest says vocab_size
  1024 and max_token 1000, which the cached open cannot see."""
  path = tmp_path / "ds"
  rng = np.random.default_rng(0)
  with shards.ShardWriter(str(path), vocab_size=2048, tokenizer_fingerprint="low",
                          shard_tokens=400,
                          metadata={"tokenizer": {"bos_id": 1, "eos_id": 2}}) as w:
    for _ in range(120):
      w.write(rng.integers(3, 2048, size=int(rng.integers(5, 40))))
  shards.ShardSource(path)
  manifest = json.loads((path / "manifest.json").read_text())
  manifest["vocab_size"] = 1024
  for shard in manifest["shards"]:
    shard["max_token"] = 1000
  (path / "manifest.json").write_text(json.dumps(manifest))
  shards.ShardSource(path)  # opens: the edit agrees with itself
  return path


def test_a_lowered_vocab_size_is_refused_where_rows_are_read(dataset):
  for build in (read_every_row, lambda ds: [ds[i] for i in range(len(ds))]):
    rows = segpack.pack_dataset(str(dataset), seq_len=64, num_epochs=1, shuffle=False)
    with pytest.raises(shards.ShardFormatError) as e:
      build(rows)
    found = re.fullmatch(
        rf"{dataset}/(shard-\d+\.tokens): token id (\d+) at position (\d+) \(document \d+ of "
        rf"the dataset\) is >= vocab_size 1024 of {dataset}/manifest.json; .*", str(e.value))
    assert found, str(e.value)
    name, token, position = found.group(1), int(found.group(2)), int(found.group(3))
    assert 1024 <= token == np.fromfile(dataset / name, "<u2")[position]


def test_a_lowered_vocab_size_stops_the_trainer_and_a_mixture(dataset, tmp_path):
  data = data_lib.make_data(spec(train=str(dataset), seq_len=64), batch_size=4,
                            process_index=0, process_count=1)
  with pytest.raises(shards.ShardFormatError, match="is >= vocab_size 1024"):
    for k in range(data.train_rows_in_epoch0 // 4 + 1):
      data.train[k]
  with pytest.raises(shards.ShardFormatError, match="is >= vocab_size 1024"):
    for k in range(len(data.eval)):
      data.eval[k]
  shutil.copytree(dataset, tmp_path / "other")
  mixed = segpack.pack_dataset(segpack.Mixture.parse(f"a={dataset}:1,b={tmp_path / 'other'}:1"),
                               seq_len=64, num_epochs=1)
  with pytest.raises(shards.ShardFormatError, match="is >= vocab_size 1024"):
    read_every_row(mixed)


def test_a_uint32_id_that_wraps_negative_in_int32_is_refused(tmp_path):
  path = tmp_path / "big"
  with shards.ShardWriter(str(path), vocab_size=70000, tokenizer_fingerprint="big",
                          metadata={"tokenizer": {"bos_id": 1, "eos_id": 2}}) as w:
    for n in (5, 9, 4):
      w.write(np.arange(3, 3 + n) + 69000)
  ids = np.fromfile(path / "shard-00000.tokens", "<u4")
  ids[6] = 3_000_000_000  # int32 reads it as a negative number
  ids.tofile(path / "shard-00000.tokens")
  manifest = json.loads((path / "manifest.json").read_text())
  manifest["shards"][0]["sha256"]["tokens"] = hashlib.sha256(ids.tobytes()).hexdigest()
  (path / "manifest.json").write_text(json.dumps(manifest))
  rows = segpack.pack_dataset(str(path), seq_len=16, num_epochs=1, shuffle=False)
  with pytest.raises(shards.ShardFormatError, match="token id 3000000000 at position 6 "
                     r"\(document 1 of the dataset\) is >= vocab_size 70000"):
    read_every_row(rows)


def test_a_padding_id_past_the_vocabulary_is_no_token_error(tmp_path):
  path = tmp_path / "ok"
  with shards.ShardWriter(str(path), vocab_size=100, tokenizer_fingerprint="ok",
                          metadata={"tokenizer": {"bos_id": 1, "eos_id": 2}}) as w:
    for n in (5, 9, 4, 30):
      w.write(np.full(n, 50))
  rows = segpack.pack_dataset(str(path), seq_len=32, num_epochs=1, shuffle=False,
                              special_tokens=segpack.SpecialTokens(pad_id=500))
  batch = rows.get_batch(np.arange(len(rows)))
  assert (batch["input_ids"][batch["segment_ids"] == 0] == 500).any()

"""`segpack bench tokenize` at a tiny size, and the oracle it rests on: `segpack tokenize` writes
the same bytes as it did before it wrote whole chunks (`segpack.cli.tokenize_baseline`).

`ShardWriter.write_many` is checked against `ShardWriter.write` of each document (shard
boundaries, empty documents, an id out of range); the whole command against the frozen old
path, file for file, on JSONL with empty and non-ASCII documents, one and two workers, and
shards small enough that several close mid-chunk.
"""

import json

import numpy as np
import pytest
from support import small_corpus

from segpack import shards
from segpack.bench import tokenize as bench
from segpack.cli import tokenize_baseline
from segpack.text import dataset, encode, input_ranges


def _documents(rng, count):
  sizes = rng.integers(0, 60, size=count)
  sizes[rng.random(count) < 0.2] = 0  # empty documents, here and there
  return [rng.integers(0, 500, size=int(k)) for k in sizes]


@pytest.mark.parametrize("shard_tokens", [1, 37, 200, 10**6])
def test_write_many_writes_the_files_of_write(tmp_path, shard_tokens):
  rng = np.random.default_rng(shard_tokens)
  docs = _documents(rng, 300)
  with shards.ShardWriter(tmp_path / "one", vocab_size=500, tokenizer_fingerprint="t",
                          shard_tokens=shard_tokens) as w:
    for d in docs:
      w.write(d)
  with shards.ShardWriter(tmp_path / "many", vocab_size=500, tokenizer_fingerprint="t",
                          shard_tokens=shard_tokens) as w:
    cuts = np.sort(rng.choice(np.arange(1, len(docs)), size=20, replace=False))
    for part in np.split(np.arange(len(docs)), cuts):
      group = [docs[i] for i in part]
      w.write_many(np.concatenate(group), [g.size for g in group])
    w.write_many(np.zeros(0, np.int64), [])
    w.write_many(np.zeros(0, np.int64), [0, 0])
  with shards.ShardWriter(tmp_path / "end", vocab_size=500, tokenizer_fingerprint="t",
                          shard_tokens=shard_tokens) as w:
    for d in docs:
      w.write(d)
    w.write([])
    w.write([])
  assert bench.same_bytes(tmp_path / "many", tmp_path / "end")
  assert not bench.same_bytes(tmp_path / "many", tmp_path / "one")  # two more empty documents


def test_write_many_refuses_what_write_refuses(tmp_path):
  with shards.ShardWriter(tmp_path / "a", vocab_size=50, tokenizer_fingerprint="t") as w:
    w.write([1, 2])
    with pytest.raises(ValueError, match="document 2 has token id 50 outside"):
      w.write_many(np.array([3, 4, 5, 50, 6]), [2, 3])
    assert w.inputs == 2  # the good document before the bad one went in, as with write()
    with pytest.raises(ValueError, match="lengths sum to 3 but there are 2 tokens"):
      w.write_many(np.array([1, 2]), [1, 2])
    with pytest.raises(TypeError, match="1-D integer array"):
      w.write_many(np.array([1.5]), [1])
  with shards.ShardWriter(tmp_path / "m", vocab_size=50, tokenizer_fingerprint="t",
                          loss_mask=True) as w:
    with pytest.raises(ValueError, match="takes no loss masks"):
      w.write_many(np.array([1]), [1])
    w.write([1], loss_mask=[1])


def _jsonl(path, texts):
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
  return path


@pytest.mark.parametrize("workers", [1, 2])
def test_the_old_and_new_paths_write_the_same_bytes(tmp_path, model, workers, monkeypatch):
  texts = small_corpus.train_texts(80)
  texts = texts[:30] + ["", "déjà vu, naïve café: ▁ ü 漢字 🙂", "   "] + texts[30:] + [""]
  inp = _jsonl(tmp_path / "in.jsonl", texts)
  monkeypatch.setattr(encode, "_CHUNK_DOCS", 7)  # many chunks, shards closing inside them
  monkeypatch.setattr(input_ranges, "RANGE_BYTES", 20_000)  # the same with workers reading
  common = ["--input", str(inp), "--spm-model", str(model), "--workers", str(workers),
            "--shard-tokens", "3000", "--no-progress"]
  assert tokenize_baseline.main(common + ["--output", str(tmp_path / "before")]) == 0
  assert encode.write_dataset is not tokenize_baseline.write_dataset_before  # put back
  (summary,) = dataset.tokenize_files([inp], tmp_path / "after", spm_model=model,
                                      workers=workers, shard_tokens=3000)
  manifest = json.loads((tmp_path / "after" / "manifest.json").read_text())
  assert len(manifest["shards"]) > 3 and manifest["skipped_empty"] == 2
  assert set(encode.STAGES) <= set(summary.stages)
  assert ("worker_read" in summary.stages) == (workers > 1)  # the workers read the JSONL
  assert bench.same_bytes(tmp_path / "before", tmp_path / "after")
  # The comparison sees a changed byte.
  tokens = tmp_path / "after" / "shard-00001.tokens"
  data = bytearray(tokens.read_bytes())
  data[5] ^= 1
  tokens.write_bytes(bytes(data))
  assert not bench.same_bytes(tmp_path / "before", tmp_path / "after")


def test_a_new_path_that_writes_other_shards_is_caught(tmp_path, model, monkeypatch):
  inp = _jsonl(tmp_path / "in.jsonl", small_corpus.train_texts(20))
  dataset.tokenize_files([inp], tmp_path / "ref", spm_model=model, workers=1)
  real = shards.ShardWriter.write_many

  def drop_last_token(self, tokens, lengths):
    lengths = np.array(lengths)
    lengths[-1] -= 1
    real(self, np.asarray(tokens)[:-1], lengths)

  monkeypatch.setattr(shards.ShardWriter, "write_many", drop_last_token)
  dataset.tokenize_files([inp], tmp_path / "bad", spm_model=model, workers=1)
  assert not bench.same_bytes(tmp_path / "ref", tmp_path / "bad")


@pytest.mark.slow
def test_benchmark_at_a_tiny_size(tmp_path, capsys):
  argv = ["--mb", "0.3", "--repeats", "1", "--vocab-size", "600", "--work-dir",
          str(tmp_path / "work")]
  assert bench.main(argv + ["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  rows = out["results"]
  paths = [(r["tokenizer"], r["path"]) for r in rows]
  assert paths[:2] in ([("spm", "alone"), ("spm", "alone_numpy")],
                       [("spm", "alone"), ("spm", "segpack")])
  assert ("spm", "segpack") in paths and ("spm", "before") in paths
  assert [p for p in paths if p[0] == "hf"] == [("hf", "alone"), ("hf", "segpack"),
                                                ("hf", "before")]
  assert out["corpus"]["bytes"] >= 0.3e6 and out["corpus"]["source_files"] > 100
  for r in rows:
    assert r["seconds"] > 0 and r["mb_per_s"] > 0 and r["of_alone"] > 0
    if r["path"] == "segpack":
      assert r["same_bytes"] == "yes"
      assert {"read", "encode", "write", "hash", "other"} <= set(r)
      assert sum(r[k] for k in ("read", "encode", "write", "hash", "other")) == pytest.approx(
          r["seconds"])
    if r["path"].startswith("alone"):
      assert r["alone_tokens"] == r["tokens"]  # the same texts, the same tokens
  # The table, from the kept text and tokenizers.
  assert bench.main(argv + ["--kinds", "spm", "--no-baseline"]) == 0
  table = capsys.readouterr().out
  assert table.splitlines()[0].split()[:3] == ["tokenizer", "path", "seconds"]
  assert "same_bytes" in table and "standard-library sources" in table
  assert "before" not in table


def test_bad_kinds_are_named(capsys):
  assert bench.main(["--kinds", "spm,gpt"]) == 2
  assert "--kinds 'spm,gpt'" in capsys.readouterr().err

"""`segpack tokenize` (segpack/cli/tokenize.py) and the text pipeline behind it (segpack/text)."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from segpack.text import corpus
from segpack.text.tokenizers import spm
from segpack.cli import tokenize as tokenize_cli
from segpack.text import dataset
from segpack.text import encode
from segpack.text import inputs
from segpack.shards import ShardFormatError, ShardSource

from support import small_corpus
from support import paths

ROOT = paths.REPO


_jsonl = small_corpus.write_jsonl


def _decoded(path, model):
  tok = spm.SpmTokenizer(model)
  src = ShardSource(path)
  src.verify()
  return [tok.decode(src[i]) for i in range(len(src))]


def test_txt_jsonl_and_gz_inputs_round_trip_in_order(tmp_path, model, texts):
  a = tmp_path / "a.txt"
  a.write_text(texts[0], encoding="utf-8")
  b = _jsonl(tmp_path / "b.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts[1:40])])
  c = _jsonl(tmp_path / "c.jsonl.gz", [{"body": t} for t in texts[40:]] + [{"body": ""}], gz=True)
  (s,) = dataset.tokenize_files([a, b], tmp_path / "out1", spm_model=model, workers=1)
  assert _decoded(tmp_path / "out1", model) == texts[:40]
  (s,) = dataset.tokenize_files([c], tmp_path / "out2", spm_model=model, workers=1,
                                 text_field="body")
  assert _decoded(tmp_path / "out2", model) == texts[40:]
  assert s.skipped_empty == 1 and s.documents == len(texts) - 40
  lengths = ShardSource(tmp_path / "out2").lengths
  assert s.tokens == lengths.sum() and s.median_length == np.median(lengths)
  assert s.dtype == "uint16"
  tok = ShardSource(tmp_path / "out2").manifest["metadata"]["tokenizer"]
  assert (tok["pad_id"], tok["bos_id"], tok["eos_id"]) == (0, 2, 3)
  assert tok["fingerprint"] == spm.SpmTokenizer(model).fingerprint


def test_blank_line_separator_and_directories(tmp_path, model):
  d = tmp_path / "in"
  d.mkdir()
  (d / "2.txt").write_text("third doc\n\n\n   \nfourth\ndoc\n", encoding="utf-8")
  (d / "1.txt").write_text("first\n  line two\n\nsecond\n", encoding="utf-8")
  (d / "ignored.csv").write_text("x")
  dataset.tokenize_files([d], tmp_path / "out", spm_model=model, workers=1,
                          doc_separator="blank-line")
  assert _decoded(tmp_path / "out", model) == [
      "first\n  line two\n", "second\n", "third doc\n", "fourth\ndoc\n"]


def test_workers_give_identical_shards(tmp_path, model, texts):
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
  dataset.tokenize_files([inp], tmp_path / "w1", spm_model=model, workers=1, shard_tokens=5000)
  dataset.tokenize_files([inp], tmp_path / "w2", spm_model=model, workers=2, shard_tokens=5000)
  m1 = json.loads((tmp_path / "w1" / "manifest.json").read_text())
  m2 = json.loads((tmp_path / "w2" / "manifest.json").read_text())
  assert len(m1["shards"]) > 3
  assert m1["shards"] == m2["shards"]
  assert ShardSource(tmp_path / "w1").fingerprint == ShardSource(tmp_path / "w2").fingerprint


def test_vocab_size_trains_a_model_first(tmp_path, texts):
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts[:60]])
  (s,) = dataset.tokenize_files([inp], tmp_path / "out", vocab_size=500, workers=1)
  assert (tmp_path / "out" / "spm.model").exists()
  assert ShardSource(tmp_path / "out").vocab_size == 500
  assert _decoded(tmp_path / "out", tmp_path / "out" / "spm.model") == texts[:60]


def test_rerun_of_a_complete_dataset_is_a_no_op_and_other_settings_need_overwrite(
    tmp_path, model, texts):
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts[:20]])
  dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1)
  stamp = (tmp_path / "out" / "manifest.json").stat().st_mtime_ns
  (s,) = dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1)
  assert (tmp_path / "out" / "manifest.json").stat().st_mtime_ns == stamp
  assert s.documents == 20
  with pytest.raises(inputs.InputFormatError, match="already holds a dataset.*--overwrite"):
    dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1, shard_tokens=7)
  dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1, shard_tokens=1000,
                          overwrite=True)
  assert len(ShardSource(tmp_path / "out").manifest["shards"]) > 1


def test_refused_rerun_leaves_the_dataset_and_its_model_untouched(tmp_path, model, texts):
  # The model beside a finished dataset is checked before it would be retrained or replaced.
  a = _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:40]])
  b = _jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts[40:80]])
  out = tmp_path / "out"
  dataset.tokenize_files([a], out, vocab_size=500, workers=1)
  before = (out / "spm.model").read_bytes()
  with pytest.raises(inputs.InputFormatError,
                     match="already holds a dataset.*spm.model.*--overwrite"):
    dataset.tokenize_files([b], out, vocab_size=500, workers=1)
  assert (out / "spm.model").read_bytes() == before
  assert _decoded(out, out / "spm.model") == texts[:40]
  dataset.tokenize_files(["builtin:small"], tmp_path / "bi", spm_model=model, workers=1)
  with pytest.raises(inputs.InputFormatError, match="already holds a dataset.*--overwrite"):
    dataset.tokenize_files(["builtin:small"], tmp_path / "bi", spm_model=out / "spm.model",
                            workers=1)
  assert (tmp_path / "bi" / "spm.model").read_bytes() == Path(model).read_bytes()
  ShardSource(tmp_path / "bi" / "train").verify()


# -----------------------------------------------------------------------------------------------
# Interruption: a rerun completes, and no partial shard is ever listed or looks valid.


def _failing(texts, after):
  for i, t in enumerate(texts):
    if i == after:
      raise KeyboardInterrupt
    yield t


def test_interrupted_run_resumes_and_matches_a_single_run(tmp_path, model, texts, monkeypatch):
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
  dataset.tokenize_files([inp], tmp_path / "ref", spm_model=model, workers=1, shard_tokens=3000)
  real = inputs.iter_documents
  monkeypatch.setattr(encode, "_CHUNK_DOCS", 8)  # Else all 120 documents form one chunk.
  monkeypatch.setattr(dataset, "iter_documents", lambda *a, **k: _failing(real(*a, **k), 90))
  with pytest.raises(KeyboardInterrupt):
    dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1,
                            shard_tokens=3000)
  with pytest.raises(ShardFormatError, match="missing manifest"):
    ShardSource(tmp_path / "out")
  monkeypatch.setattr(dataset, "iter_documents", real)
  (s,) = dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1,
                                 shard_tokens=3000)
  assert s.resumed_shards > 0
  ref = json.loads((tmp_path / "ref" / "manifest.json").read_text())
  got = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert got["shards"] == ref["shards"]
  assert _decoded(tmp_path / "out", model) == texts


@pytest.mark.parametrize("workers", [1, 2])
def test_killed_process_resumes(tmp_path, model, texts, workers):
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": t} for _ in range(4) for t in texts])
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "segpack", "tokenize", "--input", str(inp), "--output", str(out),
         "--spm-model", str(model), "--workers", str(workers), "--shard-tokens", "1000",
         "--no-progress"]
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline and len(list(out.glob("*.done.json"))) < 3:
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (out / "manifest.json").exists(), "finished before it could be killed"
  with pytest.raises(ShardFormatError, match="missing manifest"):
    ShardSource(out)
  rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
  assert "kept from an earlier run" in rerun.stdout
  kept = int(rerun.stdout.split("kept from an earlier run)")[1].split("(")[1].split(")")[0])
  assert kept >= 3
  assert not [p for p in out.iterdir() if p.name.endswith((".tmp", ".done.json"))]
  assert _decoded(out, model) == [t for _ in range(4) for t in texts]


# -----------------------------------------------------------------------------------------------
# Bad input: each error names the file, line or argument and the value.


def test_line_that_is_not_json(tmp_path, model):
  inp = tmp_path / "bad.jsonl"
  inp.write_text('{"text": "ok"}\n\n{"text": "also ok"}\n{"text": broken\n')
  with pytest.raises(inputs.InputFormatError, match=f"{inp}:4: not JSON .*broken"):
    dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1)
  with pytest.raises(ShardFormatError):
    ShardSource(tmp_path / "out")


def test_line_without_the_field(tmp_path, model):
  inp = _jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"content": "b"}, {"text": 5}, [1]])
  with pytest.raises(inputs.InputFormatError, match=f"{inp}:2: no field 'text' .*content"):
    dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1)
  inp2 = _jsonl(tmp_path / "bad2.jsonl", [{"text": 5}])
  with pytest.raises(inputs.InputFormatError, match=f"{inp2}:1: field 'text' is int.*5"):
    dataset.tokenize_files([inp2], tmp_path / "out", spm_model=model, workers=1)


def test_skip_bad_lines_counts_and_continues(tmp_path, model):
  inp = tmp_path / "bad.jsonl"
  inp.write_text('{"text": "one"}\nnot json\n{"x": 1}\n[2]\n{"text": "two"}\n')
  (s,) = dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1,
                                 skip_bad_lines=True)
  assert s.bad_lines == 3
  assert _decoded(tmp_path / "out", model) == ["one", "two"]


def test_corrupt_gzip(tmp_path, model):
  good = gzip.compress(b'{"text": "a"}\n' * 1000)
  inp = tmp_path / "cut.jsonl.gz"
  inp.write_bytes(good[: len(good) // 2])
  with pytest.raises(inputs.InputFormatError, match="cut.jsonl.gz: unreadable after line"):
    dataset.tokenize_files([inp], tmp_path / "o", spm_model=model, workers=1)


def test_bad_files_and_arguments(tmp_path, model):
  with pytest.raises(inputs.InputFormatError,
                     match=r"^input '.*missing.txt' \(inputs, --input\): no such file"):
    dataset.tokenize_files([tmp_path / "missing.txt"], tmp_path / "o", spm_model=model)
  (tmp_path / "x.csv").write_text("a")
  with pytest.raises(inputs.InputFormatError,
                     match=r"x.csv' \(inputs, --input\): unsupported file type"):
    dataset.tokenize_files([tmp_path / "x.csv"], tmp_path / "o", spm_model=model)
  (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
  with pytest.raises(inputs.InputFormatError, match="latin.txt: not UTF-8"):
    dataset.tokenize_files([tmp_path / "latin.txt"], tmp_path / "o", spm_model=model, workers=1)
  (tmp_path / "a.txt").write_text("a")
  with pytest.raises(inputs.InputFormatError,
                     match=r"spm_model=FILE \(--spm-model\) or vocab_size=N \(--vocab-size"):
    dataset.tokenize_files([tmp_path / "a.txt"], tmp_path / "o")
  with pytest.raises(inputs.InputFormatError,
                     match=r"^workers \(--workers\) must be a positive int, got 0$"):
    dataset.tokenize_files([tmp_path / "a.txt"], tmp_path / "o", spm_model=model, workers=0)
  with pytest.raises(inputs.InputFormatError,
                     match=r"inputs \(--input\) holding builtin.* must hold it alone"):
    dataset.tokenize_files(["builtin", tmp_path / "a.txt"], tmp_path / "o")
  with pytest.raises(FileNotFoundError, match="nope.model"):
    dataset.tokenize_files([tmp_path / "a.txt"], tmp_path / "o", spm_model=tmp_path / "nope.model")


def test_cli_prints_summary_or_error(tmp_path, model, capsys):
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": "hello world"}, {"text": "two"}])
  rc = tokenize_cli.main(["--input", str(inp), "--output", str(tmp_path / "o"), "--spm-model",
                      str(model), "--workers", "1", "--no-progress"])
  out = capsys.readouterr().out
  assert rc == 0
  for word in ("documents", "tokens", "mean / median / p99", "uint16", "skipped empty"):
    assert word in out
  rc = tokenize_cli.main(["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o2"),
                      "--spm-model", str(model)])
  assert rc == 2
  assert "nope.jsonl" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    tokenize_cli.main(["--input", str(inp), "--output", "x", "--spm-model", "m",
                       "--vocab-size", "9"])


def test_builtin_small_cli_writes_train_eval_and_model(tmp_path, model, capsys):
  cache = Path(model).parent.parent
  rc = tokenize_cli.main(["--input", "builtin:small", "--output", str(tmp_path / "b"),
                          "--cache-dir", str(cache), "--workers", "1", "--no-progress"])
  assert rc == 0
  assert (tmp_path / "b" / "spm.model").read_bytes() == Path(model).read_bytes()
  for split in ("train", "eval"):
    names_texts = list(corpus.builtin_documents(split=split, size="small"))
    src = ShardSource(tmp_path / "b" / split)
    assert len(src) == len(names_texts)
  assert capsys.readouterr().out.count("  dataset  ") == 2

"""`segpack tokenize --runner beam` (segpack/text/beam/pipeline.py) on Beam's DirectRunner.

The oracle is the local path (`--runner local`, worker processes and one ShardWriter) and, for the
JSONL inputs, each document encoded alone: the Beam dataset must hold the same documents, in the
same order, with the same tokens, whatever the number of Beam workers, after a kill and a rerun
too. Shard boundaries may differ (a Beam shard never spans two work units).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from segpack.shards import ShardFormatError, ShardSource
from segpack.text.beam import pipeline as beam_pipeline
from segpack.text import corpus
from segpack.text import dataset
from segpack.text import inputs
from segpack.text.tokenizers import spm
from segpack.shards.format import metadata_sha256

from support import small_corpus
from support import paths

ROOT = paths.REPO
TWO_PROCESSES = "--direct_num_workers=2 --direct_running_mode=multi_processing"
TWO_THREADS = "--direct_num_workers=2 --direct_running_mode=multi_threading"


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
  return small_corpus.cache_dir(tmp_path_factory)


_jsonl = small_corpus.write_jsonl


def _documents(path):
  src = ShardSource(path)
  src.verify()
  return [np.array(src[i]) for i in range(len(src))]


def _assert_same_dataset(got, want):
  """Document for document: same count, order, lengths and tokens; same totals and tokenizer."""
  g, w = ShardSource(got), ShardSource(want)
  np.testing.assert_array_equal(g.lengths, w.lengths)
  for i, (a, b) in enumerate(zip(_documents(got), _documents(want))):
    assert a.dtype == b.dtype and np.array_equal(a, b), f"document {i} differs"
  for key in ("dtype", "vocab_size", "tokenizer_fingerprint", "num_documents", "num_tokens",
              "skipped_empty", "inputs"):
    assert g.manifest[key] == w.manifest[key], key
  assert g.manifest["metadata"]["tokenizer"] == w.manifest["metadata"]["tokenizer"]


def test_builtin_corpus_on_beam_equals_the_local_path(tmp_path, cache, model):
  local = dataset.tokenize_files(["builtin:small"], tmp_path / "local", cache_dir=cache,
                                 workers=1, shard_tokens=20_000)
  beam = dataset.tokenize_files(["builtin:small"], tmp_path / "beam", cache_dir=cache,
                                shard_tokens=20_000, runner="beam", unit_records=64,
                                beam_options=TWO_THREADS)
  assert [s.documents for s in beam] == [s.documents for s in local]
  for split in ("train", "eval"):
    _assert_same_dataset(tmp_path / "beam" / split, tmp_path / "local" / split)
  train = ShardSource(tmp_path / "beam" / "train")
  assert train.manifest["metadata"]["runner"] == "beam"
  assert len(train) == len(list(corpus.builtin_documents(split="train", size="small")))
  assert train.num_shards > len(train) // 64  # Several units, some split into several shards.
  assert (tmp_path / "beam" / "spm.model").read_bytes() == Path(model).read_bytes()
  assert not [p for p in (tmp_path / "beam" / "train").iterdir()
              if p.name.endswith((".tmp", ".done.json"))]


def test_jsonl_on_two_beam_worker_processes_equals_the_local_path(tmp_path, model, texts):
  a = _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:70]] + [{"text": ""}])
  with open(a, "a") as f:
    f.write("not json\n")
  b = _jsonl(tmp_path / "b.jsonl.gz", [{"text": t} for t in texts[70:]], gz=True)
  kw = dict(spm_model=model, shard_tokens=4000, skip_bad_lines=True)
  (local,) = dataset.tokenize_files([a, b], tmp_path / "local", workers=1, **kw)
  (beam,) = dataset.tokenize_files([a, b], tmp_path / "beam", runner="beam", unit_records=16,
                                   beam_options=TWO_PROCESSES, **kw)
  _assert_same_dataset(tmp_path / "beam", tmp_path / "local")
  tok = spm.SpmTokenizer(model)  # Each document encoded alone.
  want = [tok.encode(t) for t in texts if t]
  got = _documents(tmp_path / "beam")
  assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
  assert (beam.skipped_empty, beam.bad_lines) == (local.skipped_empty, local.bad_lines) == (1, 1)
  assert beam.text_bytes > 0 and beam.resumed_shards == 0
  names = [s["tokens"] for s in ShardSource(tmp_path / "beam").manifest["shards"]]
  assert names == sorted(names) and names[0] == "shard-00000-00000-00000.tokens"
  assert any(n.startswith("shard-00001-") for n in names)


def test_hugging_face_tokenizer_is_rebuilt_on_the_workers(tmp_path, texts):
  tokenizers = pytest.importorskip("tokenizers")
  byte_level = tokenizers.pre_tokenizers.ByteLevel
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = byte_level(add_prefix_space=False)
  tok.train_from_iterator(texts[:20], tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<unk>"], show_progress=False,
      initial_alphabet=byte_level.alphabet()))
  tok.save(str(tmp_path / "tokenizer.json"))
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts[:40]])
  spec = f"hf:{tmp_path / 'tokenizer.json'}"
  dataset.tokenize_files([inp], tmp_path / "local", tokenizer=spec, workers=1)
  dataset.tokenize_files([inp], tmp_path / "beam", tokenizer=spec, runner="beam",
                         unit_records=8)
  _assert_same_dataset(tmp_path / "beam", tmp_path / "local")
  want = [np.array(tok.encode(t, add_special_tokens=False).ids) for t in texts[:40]]
  assert len(_documents(tmp_path / "beam")) == len(want) == 40
  assert all(np.array_equal(g, w) for g, w in zip(_documents(tmp_path / "beam"), want))


def test_killed_beam_run_reruns_complete_and_identical(tmp_path, model, texts):
  docs = [t for _ in range(8) for t in texts]
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": t} for t in docs])
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "segpack", "tokenize", "--input", str(inp), "--output", str(out),
         "--spm-model", str(model), "--runner", "beam", "--unit-records", "8",
         "--shard-tokens", "3000", "--no-progress"]
  # A killed Beam leaves its pipeline's temporary directory behind: keep it in the test's own.
  (tmp_path / "tmp").mkdir()
  env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path / "tmp"))
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline and len(list(out.glob("*.done.json"))) < 3:
    time.sleep(0.005)
  os.killpg(proc.pid, signal.SIGKILL)  # The runner and any worker it started.
  proc.wait()
  assert not (out / "manifest.json").exists(), "finished before it could be killed"
  with pytest.raises(ShardFormatError, match="missing manifest"):
    ShardSource(out)
  rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
  kept = int(rerun.stdout.split("kept from an earlier run)")[1].split("(")[1].split(")")[0])
  assert kept >= 3, rerun.stdout
  assert not [p for p in out.iterdir() if p.name.endswith((".tmp", ".done.json"))]
  assert "Traceback" not in rerun.stderr
  dataset.tokenize_files([inp], tmp_path / "once", spm_model=model, runner="beam",
                         unit_records=8, shard_tokens=3000)
  assert (ShardSource(out).manifest["shards"]
          == ShardSource(tmp_path / "once").manifest["shards"])  # Same files, same checksums.
  dataset.tokenize_files([inp], tmp_path / "local", spm_model=model, workers=1)
  _assert_same_dataset(out, tmp_path / "local")
  assert len(ShardSource(out)) == len(docs)


def test_retried_unit_rewrites_the_same_files_and_leaves_no_partial_one(tmp_path, model, texts):
  tok = spm.SpmTokenizer(model)
  out = tmp_path / "out"
  out.mkdir()
  kw = dict(output=str(out), spec=tok.spec, fingerprint=tok.fingerprint, shard_tokens=2000,
            unit_records=10, resume_key="k")
  values = [(10 + r, t) for r, t in enumerate(texts[:10])]
  first = beam_pipeline._write_unit(((0, 1), values), **kw)
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  (out / "shard-00000-00001-00000.tokens.123-abcd.tmp").write_bytes(b"half")  # A killed try.
  again = beam_pipeline._write_unit(((0, 1), values[::-1]), **kw)  # Another order, same unit.
  assert again == first
  after = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.endswith(".tmp")}
  assert after == before
  assert len(first["shards"]) > 1 and first["inputs"] == 10
  with pytest.raises(RuntimeError, match=r"unit \(0, 1\) got records"):
    beam_pipeline._write_unit(((0, 1), values + values[:1]), **kw)  # A duplicated record.
  header = {"format": "segpack-shards", "format_version": 1, "dtype": "uint16",
            "byte_order": "little", "vocab_size": tok.vocab_size,
            "tokenizer_fingerprint": tok.fingerprint, "resume_key": "k", "metadata": {},
            "metadata_sha256": metadata_sha256({})}  # as write_dataset_beam's header has it
  with pytest.raises(RuntimeError, match=r"input 0: units \[1\] are not 0, 1"):
    beam_pipeline._write_manifest([first], output=str(out), header=header, unit_records=10)
  assert not (out / "manifest.json").exists()
  zero = beam_pipeline._write_unit(((0, 0), [(r, t) for r, t in enumerate(texts[10:20])]), **kw)
  beam_pipeline._write_manifest([first, zero], output=str(out), header=header, unit_records=10)
  assert sorted(p.name for p in out.iterdir() if not p.name.startswith("shard-0000")) == [
      "manifest.json"]
  assert not [p for p in out.iterdir() if p.name.endswith((".tmp", ".done.json"))]
  got = _documents(out)
  assert len(got) == 20
  assert all(np.array_equal(g, tok.encode(t)) for g, t in zip(got, texts[10:20] + texts[:10]))


def test_complete_dataset_is_kept_and_other_settings_need_overwrite(tmp_path, model, texts):
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts[:30]])
  kw = dict(spm_model=model, runner="beam", unit_records=8)
  dataset.tokenize_files([inp], tmp_path / "out", **kw)
  stamp = (tmp_path / "out" / "manifest.json").stat().st_mtime_ns
  (s,) = dataset.tokenize_files([inp], tmp_path / "out", **kw)
  assert (tmp_path / "out" / "manifest.json").stat().st_mtime_ns == stamp and s.documents == 30
  with pytest.raises(inputs.InputFormatError, match="already holds a dataset.*--overwrite"):
    dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1)
  dataset.tokenize_files([inp], tmp_path / "out", spm_model=model, workers=1, overwrite=True)
  # The local writer removed the Beam files: only its own shards and the manifest are left.
  assert not [p for p in (tmp_path / "out").iterdir() if p.name.count("-") > 1]
  assert len(ShardSource(tmp_path / "out")) == 30


def test_errors_name_the_flag_and_the_extra(tmp_path, model, monkeypatch):
  inp = _jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
  with pytest.raises(inputs.InputFormatError,
                     match=r"^runner \(--runner\) must be 'local' or 'beam', got 'x'$"):
    dataset.tokenize_files([inp], tmp_path / "o", spm_model=model, runner="x")
  with pytest.raises(inputs.InputFormatError,
                     match=r"^unit_records \(--unit-records\) must be a positive int, got 0$"):
    dataset.tokenize_files([inp], tmp_path / "o", spm_model=model, runner="beam", unit_records=0)
  chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
  with pytest.raises(inputs.InputFormatError,
                     match=r"runner='beam' \(--runner\) tokenizes plain text"):
    dataset.tokenize_files([chat], tmp_path / "o", spm_model=model, runner="beam")
  monkeypatch.setitem(sys.modules, "apache_beam", None)  # As when the extra is not installed.
  with pytest.raises(inputs.InputFormatError, match=r"segpack\[beam\]"):
    dataset.tokenize_files([inp], tmp_path / "o", spm_model=model, runner="beam")
  assert not (tmp_path / "o" / "manifest.json").exists()


@pytest.mark.parametrize("mode", ["in_memory", "multi_processing"])
def test_bad_record_is_one_line_error_without_traceback(tmp_path, model, mode):
  good = _jsonl(tmp_path / "a.jsonl", [{"text": "fine text"}] * 3)
  bad = _jsonl(tmp_path / "b.jsonl", [{"text": "ok"}, {"text": 5}, {"text": "never read"}])
  out = tmp_path / "out"
  options = f"--direct_running_mode={mode} --direct_num_workers=2"
  cmd = [sys.executable, "-m", "segpack", "tokenize", "--input", str(good), str(bad), "--output",
         str(out), "--spm-model", str(model), "--runner", "beam", "--beam-options", options,
         "--no-progress"]
  run = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True)
  assert run.returncode == 2, run.stderr
  assert "Traceback" not in run.stderr
  ours = [line for line in run.stderr.splitlines() if line.startswith("segpack")]
  assert ours == [f"segpack tokenize: error: {bad}:2: field 'text' is int, not a string: 5 "
                  f"(pass skip_bad_lines=True (--skip-bad-lines) to count and skip such "
                  f"records)"]
  assert not (out / "manifest.json").exists() and not (out / beam_pipeline.ERRORS_FILE).exists()

"""Input readers (segpack/text/inputs.py, segpack/text/arrow_inputs.py): Parquet, hf-disk:PATH,
.gz / .zst text and JSONL, per-file record numbers, and the named errors of unusable inputs."""

import contextlib
import gzip
import io
import json
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from segpack.cli import tokenize as tokenize_cli
from segpack.shards import ShardSource
from segpack.text import arrow_inputs
from segpack.text import inputs
from segpack.text.tokenizers import spm

TEXTS = [f"document {i}: " + "word " * (i % 7) + "\nsecond line é 中" for i in range(23)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = tmp_path_factory.mktemp("model") / "m.model"
  return spm.train_spm(TEXTS, path, vocab_size=320).model_file


def _records(path, **kw):
  return list(inputs.iter_file_records(path, **kw))


def _parquet(path, columns, row_group_size=None):
  pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
  return path


def _cli(argv):
  """(exit status, stdout, stderr) of `segpack tokenize argv`, run in this process."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = tokenize_cli.main([*argv, "--workers", "1", "--no-progress"])
  return rc, out.getvalue(), err.getvalue()


def _decoded(path, model_file):
  tok = spm.SpmTokenizer(model_file)
  src = ShardSource(path)
  src.verify()
  return [tok.decode(src[i]) for i in range(len(src))]


# -----------------------------------------------------------------------------------------------
# Parquet


def test_parquet_rows_across_row_groups_and_batches(tmp_path):
  path = _parquet(tmp_path / "a.parquet", {"id": list(range(23)), "text": TEXTS},
                  row_group_size=5)
  assert pq.ParquetFile(path).num_row_groups == 5
  got = list(arrow_inputs.parquet_values(path, text_field="text", batch_rows=3))
  assert got == list(enumerate(TEXTS, start=1))
  assert _records(path) == list(enumerate(TEXTS, start=1))


def test_parquet_nulls_are_bad_records_named_by_row_or_skipped_and_counted(tmp_path):
  values = ["a", None, "b", None, "c"]
  path = _parquet(tmp_path / "n.parquet", {"text": values})
  with pytest.raises(inputs.InputFormatError,
                     match=r"n.parquet: row 2: column 'text' is null .*--skip-bad-lines"):
    _records(path)
  counters = inputs.ReadCounters()
  assert _records(path, skip_bad_lines=True, counters=counters) == [(1, "a"), (3, "b"), (5, "c")]
  assert counters.bad_lines == 2


def test_parquet_wrong_column_type_missing_column_binary_and_bad_utf8(tmp_path):
  path = _parquet(tmp_path / "t.parquet", {"text": ["x", "y"], "n": [7, 8]})
  with pytest.raises(inputs.InputFormatError, match=r"t.parquet: row 1: column 'n' is int.*: 7"):
    _records(path, text_field="n")
  with pytest.raises(inputs.InputFormatError,
                     match=r"t.parquet: no column 'body' \(found: \['n', 'text'\]\)"):
    _records(path, text_field="body")
  blob = _parquet(tmp_path / "b.parquet", {"text": pa.array([b"ok \xc3\xa9", b"\xff\xfe"])})
  with pytest.raises(inputs.InputFormatError,
                     match=r"b.parquet: row 2: column 'text' is not UTF-8"):
    _records(blob)
  assert _records(blob, skip_bad_lines=True) == [(1, "ok é")]
  # A string column holding bytes that are not UTF-8 (pyarrow does not check on write).
  raw = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(
      b"\x00\x00\x00\x00\x02\x00\x00\x00\x04\x00\x00\x00"), pa.py_buffer(b"hi\xff\xfe")])
  bad = _parquet(tmp_path / "s.parquet", {"text": raw})
  with pytest.raises(inputs.InputFormatError,
                     match=r"s.parquet: row 2: column 'text' is not UTF-8"):
    _records(bad)


@pytest.mark.parametrize("cut", [0, 7, -1, -9])
def test_parquet_without_its_footer_is_named(tmp_path, cut):
  good = _parquet(tmp_path / "g.parquet", {"text": TEXTS}).read_bytes()
  path = tmp_path / "cut.parquet"
  path.write_bytes(good[:cut] if cut > 0 else good[:len(good) + cut] if cut else b"")
  with pytest.raises(inputs.InputFormatError, match=r"cut.parquet: not a readable Parquet file"):
    _records(path)


def test_directories_take_parquet_and_compressed_files_in_sorted_order(tmp_path):
  d = tmp_path / "in"
  (d / "sub").mkdir(parents=True)
  _parquet(d / "b.parquet", {"text": TEXTS[:3]})
  (d / "sub" / "a.txt.gz").write_bytes(gzip.compress(TEXTS[3].encode()))
  (d / "c.jsonl").write_text(json.dumps({"text": TEXTS[4]}) + "\n")
  (d / "notes.csv").write_text("x")
  files = inputs.expand_inputs([d])
  assert [p.relative_to(d).as_posix() for p in files] == ["b.parquet", "c.jsonl", "sub/a.txt.gz"]
  assert list(inputs.iter_documents(files)) == TEXTS[:3] + [TEXTS[4], TEXTS[3]]


def test_missing_pyarrow_names_the_extra(tmp_path, monkeypatch):
  path = _parquet(tmp_path / "a.parquet", {"text": ["x"]})
  monkeypatch.setitem(sys.modules, "pyarrow", None)
  with pytest.raises(inputs.InputFormatError, match=r"a.parquet: .*segpack\[parquet\]"):
    _records(path)


# -----------------------------------------------------------------------------------------------
# hf-disk:PATH (datasets save_to_disk)


def test_hf_disk_reads_every_arrow_file_in_state_json_order(tmp_path):
  ds = datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(len(TEXTS)))})
  ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
  files = inputs.expand_inputs([f"hf-disk:{tmp_path / 'ds'}"])
  assert [p.name for p in files] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
  assert list(inputs.iter_documents(files)) == TEXTS
  # Record numbers restart in each Arrow file (the stable id is (file index, record)).
  per_file = [_records(p) for p in files]
  assert [r for part in per_file for _, r in part] == TEXTS
  assert all([n for n, _ in part] == list(range(1, len(part) + 1)) for part in per_file)


def test_hf_disk_dataset_dict_needs_a_split(tmp_path):
  dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:5]}),
                             "validation": datasets.Dataset.from_dict({"text": TEXTS[5:7]})})
  dd.save_to_disk(str(tmp_path / "dd"))
  with pytest.raises(inputs.InputFormatError,
                     match=r"input hf-disk:.*dd \(inputs, --input\): a DatasetDict with splits "
                           r"\['train', 'validation'\]; "
                           r"pass hf-disk:.*dd/train"):
    inputs.expand_inputs([f"hf-disk:{tmp_path / 'dd'}"])
  files = inputs.expand_inputs([f"hf-disk:{tmp_path / 'dd' / 'validation'}"])
  assert list(inputs.iter_documents(files)) == TEXTS[5:7]


def test_hf_disk_bad_directories_and_truncated_arrow_files(tmp_path):
  with pytest.raises(inputs.InputFormatError,
                     match=r"input hf-disk:.*nope \(inputs, --input\): no such directory"):
    inputs.expand_inputs([f"hf-disk:{tmp_path / 'nope'}"])
  with pytest.raises(inputs.InputFormatError, match=r"not a datasets save_to_disk directory"):
    inputs.expand_inputs([f"hf-disk:{tmp_path}"])
  datasets.Dataset.from_dict({"text": TEXTS, "x": [None] * len(TEXTS)}).save_to_disk(
      str(tmp_path / "ds"))
  (arrow,) = inputs.expand_inputs([f"hf-disk:{tmp_path / 'ds'}"])
  with pytest.raises(inputs.InputFormatError, match=r"\.arrow: row 1: column 'x' is null"):
    _records(arrow, text_field="x")
  with pytest.raises(inputs.InputFormatError, match=r"\.arrow: no column 'body'"):
    _records(arrow, text_field="body")
  data = arrow.read_bytes()
  for cut in (8, len(data) // 2, len(data) - 8, len(data) - 1):
    arrow.write_bytes(data[:cut])
    with pytest.raises(inputs.InputFormatError, match=r"\.arrow: not a (complete|readable) Arrow"):
      _records(arrow)
  arrow.unlink()
  with pytest.raises(inputs.InputFormatError, match=r"state.json: data file .* is missing"):
    inputs.expand_inputs([f"hf-disk:{tmp_path / 'ds'}"])


def test_cli_reads_parquet_and_hf_disk_into_the_same_dataset(tmp_path, model):
  _parquet(tmp_path / "a.parquet", {"body": TEXTS})
  datasets.Dataset.from_dict({"body": TEXTS}).save_to_disk(str(tmp_path / "ds"), num_shards=2)
  for name, given in (("p", str(tmp_path / "a.parquet")), ("h", f"hf-disk:{tmp_path / 'ds'}")):
    rc, _, err = _cli(["--input", given, "--output", str(tmp_path / name), "--spm-model",
                       str(model), "--text-field", "body"])
    assert rc == 0, err
    assert _decoded(tmp_path / name, model) == TEXTS


# -----------------------------------------------------------------------------------------------
# Text and JSONL, plain and compressed


def test_zstd_jsonl_and_txt_with_several_frames(tmp_path):
  zstandard = pytest.importorskip("zstandard")
  lines = [json.dumps({"text": t}) + "\n" for t in TEXTS]
  frames = [zstandard.ZstdCompressor().compress("".join(lines[i:i + 5]).encode())
            for i in range(0, len(lines), 5)]
  path = tmp_path / "a.jsonl.zst"
  path.write_bytes(b"".join(frames))
  assert _records(path) == list(enumerate(TEXTS, start=1))
  txt = tmp_path / "b.txt.zst"
  txt.write_bytes(zstandard.ZstdCompressor().compress("\n\n".join(TEXTS[:4]).encode()))
  assert [t for _, t in _records(txt, doc_separator="blank-line")] == [
      t + "\n" for t in TEXTS[:3]] + [TEXTS[3]]


def test_truncated_or_corrupt_zstd_is_named_never_read_as_shorter(tmp_path):
  zstandard = pytest.importorskip("zstandard")
  data = zstandard.ZstdCompressor().compress(b'{"text": "a"}\n' * 1000)
  path = tmp_path / "cut.jsonl.zst"
  for cut in (5, len(data) // 2, len(data) - 1):
    path.write_bytes(data[:cut])
    with pytest.raises(inputs.InputFormatError, match=r"cut.jsonl.zst: unreadable after line"):
      _records(path)
  path.write_bytes(b"\x28\xb5\x2f\xfdgarbage" + data)
  with pytest.raises(inputs.InputFormatError, match=r"cut.jsonl.zst: unreadable after line 0"):
    _records(path)


def test_missing_zstandard_is_named(tmp_path, monkeypatch):
  path = tmp_path / "a.jsonl.zst"
  path.write_bytes(b"\x28\xb5\x2f\xfd")
  monkeypatch.setitem(sys.modules, "zstandard", None)
  with pytest.raises(inputs.InputFormatError, match=r"a.jsonl.zst: .*zstandard"):
    _records(path)


def test_jsonl_record_numbers_are_line_numbers(tmp_path):
  path = tmp_path / "a.jsonl.gz"
  path.write_bytes(gzip.compress(b'{"text": "one"}\n\n  \n{"text": "two"}\n{"text": ""}'))
  assert _records(path) == [(1, "one"), (4, "two"), (5, "")]
  txt = tmp_path / "b.txt"
  txt.write_text("a\n\nb\nc\n\n\n\nd")
  assert _records(txt, doc_separator="blank-line") == [(1, "a\n"), (3, "b\nc\n"), (8, "d")]
  assert _records(txt) == [(1, "a\n\nb\nc\n\n\n\nd")]


def test_jsonl_surrogates_deep_nesting_and_non_utf8_are_bad_records(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_bytes(b'{"text": "ok"}\n{"text": "x\\ud800y"}\n' + b"[" * 100_000 + b"\n"
                   + b'{"text": "caf\xe9"}\n{"text": "\\ud83d\\ude00"}\n')
  with pytest.raises(inputs.InputFormatError, match=r"a.jsonl:2: field 'text' holds an unpaired "
                                                    r"surrogate"):
    _records(path)
  counters = inputs.ReadCounters()
  assert _records(path, skip_bad_lines=True, counters=counters) == [(1, "ok"), (5, "\U0001f600")]
  assert counters.bad_lines == 3
  path.write_bytes(b"[" * 100_000 + b"\n")
  with pytest.raises(inputs.InputFormatError, match=r"a.jsonl:1: not JSON \(RecursionError"):
    _records(path)


def test_txt_not_utf8_names_the_line(tmp_path):
  path = tmp_path / "a.txt.gz"
  path.write_bytes(gzip.compress(b"fine\nstill fine\ncaf\xe9\n"))
  for sep in ("file", "blank-line"):
    with pytest.raises(inputs.InputFormatError, match=r"a.txt.gz: not UTF-8 text at line 3"):
      _records(path, doc_separator=sep)


# -----------------------------------------------------------------------------------------------
# The same error whatever the phase: training the SentencePiece model or encoding.


def test_bad_record_met_while_training_is_the_cli_one_line_error(tmp_path, model):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "hello there"}\n{"text": 5}\n')
  want = f"segpack tokenize: error: {bad}:2: field 'text' is int, not a string: 5"
  for name, flags in (("train", ["--vocab-size", "300"]), ("encode", ["--spm-model", str(model)])):
    rc, out, err = _cli(["--input", str(bad), "--output", str(tmp_path / name), *flags])
    assert rc == 2 and out == ""
    assert err.startswith(want) and err.count("\n") == 1, err
    assert not (tmp_path / name / "manifest.json").exists()
    assert not (tmp_path / name / "spm.model").exists()


def test_train_spm_raises_the_iterator_error_itself_and_writes_no_model(tmp_path):
  def texts(error):
    yield "some text to train on"
    yield "more text"
    raise error

  for error in (inputs.InputFormatError("x.jsonl:3: bad"), KeyboardInterrupt()):
    with pytest.raises(type(error)) as caught:
      spm.train_spm(texts(error), tmp_path / "m.model", vocab_size=300)
    assert caught.value is error
    assert not (tmp_path / "m.model").exists()


def test_truncated_chat_gzip_is_the_one_line_error_in_both_phases(tmp_path, model):
  data = gzip.compress(b"".join(json.dumps({"messages": [
      {"role": "user", "content": f"question {i}"},
      {"role": "assistant", "content": f"answer {i}"}]}).encode() + b"\n" for i in range(200)))
  path = tmp_path / "chat.jsonl.gz"
  path.write_bytes(data[:len(data) - 10])
  for name, flags in (("train", ["--vocab-size", "300"]), ("encode", ["--spm-model", str(model)])):
    rc, out, err = _cli(["--input", str(path), "--output", str(tmp_path / name), "--format",
                         "chat", *flags])
    assert rc == 2 and out == ""
    assert err.startswith(f"segpack tokenize: error: {path}: unreadable (EOFError")
    assert err.count("\n") == 1, err
    assert not (tmp_path / name / "manifest.json").exists()
    assert not (tmp_path / name / "spm.model").exists()

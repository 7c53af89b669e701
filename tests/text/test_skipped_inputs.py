"""Inputs skipped without a word (issue "silent round 2", class 4): `segpack tokenize` says, by
file type, what it read and which files of the input directories it did not, and refuses a
dataset without documents in one line (exit status 2), naming the inputs.

Oracles: the files the test writes (their types and counts) and the documents it puts in them.
"""

import json
import logging

import pytest

from segpack.cli import main as cli_main
from segpack.shards import ShardSource
from segpack.text import dataset
from segpack.text import inputs

from support import small_corpus


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return str(small_corpus.spm_model(tmp_path_factory))


def tokenize(argv, model, capsys, caplog):
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="segpack.text.dataset"):
    rc = cli_main.main(["tokenize", *argv, "--spm-model", model, "--workers", "1",
                        "--no-progress"])
  out = capsys.readouterr()
  return rc, out.out, out.err, caplog.records


def test_a_directory_of_rst_files_and_one_txt_says_what_it_skipped(tmp_path, model, capsys,
                                                                   caplog):
  docs = tmp_path / "docs"
  (docs / "api").mkdir(parents=True)
  for i in range(5):
    (docs / f"page{i}.rst").write_text(f"page {i}\n")
  (docs / "api" / "index.rst").write_text("index\n")
  (docs / "conf.py").write_text("project = 'x'\n")
  (docs / "readme.txt").write_text("the only text file\n")
  rc, out, err, records = tokenize(["--input", str(docs), "--output", str(tmp_path / "out")],
                                   model, capsys, caplog)
  assert rc == 0, err
  (line,) = [r for r in records if "inputs:" in r.getMessage()]
  assert line.levelno == logging.WARNING
  assert line.getMessage() == (
      "inputs: read .txt 1 file (1 document); not read: .rst 6 files, .py 1 file in the input "
      f"directories (not an input type: {', '.join(inputs.SUFFIXES)})")
  assert len(ShardSource(tmp_path / "out")) == 1


def test_every_type_read_is_counted_with_its_documents(tmp_path, model, capsys, caplog):
  (tmp_path / "a.txt").write_text("one text\n")
  small_corpus.write_jsonl(tmp_path / "b.jsonl", [{"text": f"record {i}"} for i in range(4)])
  small_corpus.write_jsonl(tmp_path / "c.jsonl.gz", [{"text": "zipped"}, {"text": ""}], gz=True)
  rc, _, err, records = tokenize(
      ["--input", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), str(tmp_path / "c.jsonl.gz"),
       "--output", str(tmp_path / "out")], model, capsys, caplog)
  assert rc == 0, err
  (line,) = [r for r in records if "inputs:" in r.getMessage()]
  assert line.levelno == logging.INFO
  assert line.getMessage() == ("inputs: read .txt 1 file (1 document), .jsonl 1 file (4 documents),"
                               " .jsonl.gz 1 file (1 document)")


def test_a_directory_without_inputs_names_what_it_holds(tmp_path, model, capsys, caplog):
  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(3):
    (docs / f"p{i}.rst").write_text("x\n")
  rc, out, err, _ = tokenize(["--input", str(docs), "--output", str(tmp_path / "out")], model,
                             capsys, caplog)
  assert rc == 2 and out == "" and err.count("\n") == 1
  assert f"input '{docs}' (inputs, --input): directory holds no .txt" in err
  assert "(it holds .rst 3 files)" in err


@pytest.mark.parametrize("content, skip, detail", [
    ("", False, "read .jsonl 1 file (0 documents)"),
    (json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n", False,
     "read .jsonl 1 file (0 documents)"),
    ("not json\n" + json.dumps({"body": "x"}) + "\n", True,
     "read .jsonl 1 file (0 documents); 2 records without usable text skipped"),
])
def test_a_dataset_without_documents_is_refused_naming_the_inputs(tmp_path, model, capsys, caplog,
                                                                  content, skip, detail):
  empty = tmp_path / "empty.jsonl"
  empty.write_text(content)
  flags = ["--skip-bad-lines"] if skip else []
  rc, out, err, _ = tokenize(["--input", str(empty), "--output", str(tmp_path / "out"), *flags],
                             model, capsys, caplog)
  assert rc == 2 and out == "", (rc, out, err)
  assert err.count("\n") == 1
  assert err == (f"segpack tokenize: error: inputs=['{empty}'] (--input): no documents to "
                 f"tokenize "
                 f"({detail}); a dataset needs at least one document with text\n")
  assert not (tmp_path / "out" / "manifest.json").exists()


def test_an_empty_chat_file_is_refused(tmp_path, model, capsys, caplog):
  empty = tmp_path / "chat.jsonl"
  empty.write_text("\n")
  rc, out, err, _ = tokenize(["--input", str(empty), "--output", str(tmp_path / "out"),
                              "--format", "chat"], model, capsys, caplog)
  assert rc == 2 and out == "" and err.count("\n") == 1, err
  assert f"inputs=['{empty}'] (--input): no documents to tokenize (read .jsonl 1 file)" in err


def test_the_library_refuses_too(tmp_path, model):
  (tmp_path / "blank.txt").write_text("")
  with pytest.raises(inputs.InputFormatError, match="no documents to tokenize"):
    dataset.tokenize_files([tmp_path / "blank.txt"], tmp_path / "out", spm_model=model,
                           workers=1)

"""Paths the CLI must not misread: empty paths, an input given twice, names that start with
"builtin" but are the user's directories."""

import logging

import numpy as np

from segpack import shards
from segpack.cli import main as cli_main
from segpack.text import corpus


def test_empty_paths_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)  # an empty path would mean this directory
  (tmp_path / "a.txt").write_text("some text\n")
  for argv, name in ((["--input", "a.txt", "--output", ""], "output (--output)"),
                     (["--input", "", "--output", "out"], "inputs (--input)")):
    assert cli_main.main(["tokenize", *argv, "--vocab-size", "50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and "empty path" in err[0], err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # nothing written


def test_an_input_given_twice_warns_and_is_stored_twice(tmp_path, caplog):
  text = tmp_path / "a.txt"
  text.write_text("\n".join(f"line {i} of a small file of words" for i in range(200)))
  with caplog.at_level(logging.WARNING):
    rc = cli_main.main(["tokenize", "--input", str(text), str(text), "--output",
                        str(tmp_path / "out"), "--vocab-size", "300", "--no-progress"])
  assert rc == 0
  assert any(r.getMessage() == f"inputs (--input) name {text} twice: its documents are "
             "tokenized twice" for r in caplog.records)
  assert len(shards.ShardSource(str(tmp_path / "out"))) == 2  # one document per file, twice


def test_a_directory_named_builtin_something_is_the_users(tmp_path, monkeypatch, capsys):
  def no_corpus(**kwargs):
    raise AssertionError("built the built-in corpus for a user directory")

  monkeypatch.setattr(corpus, "ensure_builtin", no_corpus)
  monkeypatch.chdir(tmp_path)
  with shards.ShardWriter("builtin-mydata", vocab_size=100, tokenizer_fingerprint="t") as w:
    for n in (5, 9, 3):
      w.write(np.arange(3, 3 + n))
  assert cli_main.main(["stats", "--data", "builtin-mydata", "--seq-len", "16"]) == 0
  assert "3" in capsys.readouterr().out


def test_a_vocabulary_larger_than_the_text_says_what_was_trained(tmp_path, caplog):
  text = tmp_path / "a.txt"
  text.write_text("\n".join(f"line {i} of a small file of words" for i in range(50)))
  with caplog.at_level(logging.WARNING):
    rc = cli_main.main(["tokenize", "--input", str(text), "--output", str(tmp_path / "out"),
                        "--vocab-size", "6000", "--no-progress"])
  assert rc == 0
  vocab = shards.ShardSource(str(tmp_path / "out")).vocab_size
  assert vocab < 6000
  assert any(f"trained a {vocab}-piece" in r.getMessage() and "6000" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_stats_ends_bad_files_and_sizes_with_one_line(tmp_path, capsys):
  (tmp_path / "empty.npy").write_bytes(b"")
  (tmp_path / "ds").mkdir()
  (tmp_path / "ds" / "manifest.json").mkdir()  # unreadable as a file
  np.save(tmp_path / "ok.npy", np.array([5, 9, 3]))
  cases = [
      (["--data", str(tmp_path / "empty.npy")], "empty.npy"),
      (["--data", str(tmp_path / "ds")], "manifest.json"),
      (["--data", str(tmp_path / "ok.npy"), "--seq-len", str(2**31)], "--seq-len must be in"),
      (["--data", str(tmp_path / "ok.npy"), "--seq-len", str(2**64)], "--seq-len must be in"),
      (["--data", str(tmp_path / "ok.npy"), "--compare", "--seq-lens", "512,1k"],
       "--seq-lens: '1k'"),
  ]
  for argv, want in cases:
    assert cli_main.main(["stats", *argv]) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0], (argv, err)

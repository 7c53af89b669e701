"""A dataset tokenized with `--spm-model FILE` or `--tokenizer hf:...` holds a copy of its
tokenizer, so that training, sampling and export never depend on a path outside it."""

import shutil

import pytest

from support import small_corpus
from segpack.cli import tokenize as tokenize_cli
from train.runs import tokenizer as run_tokenizer


def test_spm_model_is_copied_and_the_dataset_survives_its_removal(tmp_path_factory, tmp_path):
  model = small_corpus.spm_model(tmp_path_factory)
  own = tmp_path / "elsewhere" / "my.model"
  own.parent.mkdir()
  shutil.copyfile(model, own)
  docs = small_corpus.write_jsonl(tmp_path / "d.jsonl",
                                  [{"text": t} for t in small_corpus.train_texts()[:20]])
  assert tokenize_cli.main(["--input", str(docs), "--spm-model", str(own), "--output",
                            str(tmp_path / "ds"), "--no-progress"]) == 0
  shutil.rmtree(own.parent)  # the model the dataset was made with is gone
  assert (tmp_path / "ds" / "my.model").is_file()
  tokenizer = run_tokenizer._dataset_tokenizer(str(tmp_path / "ds"))  # the manifest's own check
  assert tokenizer.encode("def f():") is not None
  # A rerun over the finished dataset (with the model back) keeps the copy as it is.
  before = (tmp_path / "ds" / "my.model").stat().st_mtime_ns
  own.parent.mkdir()
  shutil.copyfile(model, own)
  assert tokenize_cli.main(["--input", str(docs), "--spm-model", str(own), "--output",
                            str(tmp_path / "ds"), "--no-progress"]) == 0
  assert (tmp_path / "ds" / "my.model").stat().st_mtime_ns == before


def test_hf_tokenizer_and_its_config_are_copied(tmp_path):
  pytest.importorskip("transformers")
  from support import hf_models
  tok_dir = hf_models.make_tokenizer(str(tmp_path / "tok"))
  docs = hf_models.write_text_jsonl(str(tmp_path / "d.jsonl"), 10)
  assert tokenize_cli.main(["--input", docs, "--tokenizer", f"hf:{tok_dir}", "--output",
                            str(tmp_path / "ds"), "--no-progress"]) == 0
  shutil.rmtree(tok_dir)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (tmp_path / "ds" / name).is_file()
  tokenizer = run_tokenizer._dataset_tokenizer(str(tmp_path / "ds"))  # fingerprint checked there
  assert tokenizer.bos_id == 1 and tokenizer.eos_id == 2

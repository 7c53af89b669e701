"""Training a SentencePiece model says so once: `segpack tokenize --vocab-size N` and the trainer
building the built-in corpus's model (`segpack.text.tokenizers.cache.trained_tokenizer` with
`progress`, segpack's INFO records printed) print one line as training starts and one as it
ends, each once, and none of SentencePiece's own C++ log lines."""

import collections
import json
import logging
import random
import re

import pytest
import sentencepiece

from segpack.text.tokenizers import cache as tokenizer_cache
from support.train_configs import run_cli

# What a line says, whoever prints it: the start of a training, its end, SentencePiece's own log.
KINDS = {"starts": re.compile(r"\btraining an? .*SentencePiece model", re.I),
         "ends": re.compile(r"\btrained (the SentencePiece model|.*spm\.model) in", re.I),
         "sentencepiece's own": re.compile(r"\w+\.cc[:(]\d+|absl::InitializeLog")}


def _documents(count=300, seed=0):
  rng = random.Random(seed)
  words = "the quick brown fox jumps over a lazy dog while code and data train models".split()
  return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(count)]


def _kinds(stderr):
  """How many lines of each kind of `KINDS` `stderr` holds."""
  counts = collections.Counter()
  for line in stderr.splitlines():
    counts.update(kind for kind, pattern in KINDS.items() if pattern.search(line))
  return counts


def test_tokenize_with_a_fresh_model_says_each_line_once(tmp_path):
  docs = tmp_path / "docs.jsonl"
  docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents()))
  for flags in ((), ("--no-progress",)):  # segpack's own lines, then its INFO records
    out = tmp_path / f"out{len(flags)}"
    proc = run_cli("segpack", "tokenize", "--input", str(docs), "--output", str(out),
                   "--vocab-size", "400", "--workers", "2", *flags)
    counts = _kinds(proc.stderr)
    assert counts["starts"] == 1 and counts["ends"] == 1, (flags, proc.stderr)
    assert counts["sentencepiece's own"] == 0, proc.stderr
    assert (out / "spm.model").is_file()


@pytest.mark.parametrize("progress", [True, False])
def test_the_trainers_model_build_says_each_line_once(tmp_path, capfd, progress):
  handler = logging.StreamHandler()  # the trainer prints segpack's INFO records (absl)
  ours = logging.getLogger("segpack")
  old_level = ours.level
  ours.addHandler(handler)
  ours.setLevel(logging.INFO)
  try:
    tokenizer_cache.trained_tokenizer(_documents(), tmp_path / "spm.model", vocab_size=400,
                                      key={"test": 1}, progress=progress)
  finally:
    ours.removeHandler(handler)
    ours.setLevel(old_level)
  err = capfd.readouterr().err
  counts = _kinds(err)
  assert counts["starts"] == 1 and counts["ends"] == 1, err
  assert counts["sentencepiece's own"] == 0, err


def test_sentencepiece_own_log_lines_would_be_seen(tmp_path, capfd):
  """The negative control: SentencePiece's C++ log, when let through, reaches the captured
  stderr and is counted as its own."""
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(_documents()), model_prefix=str(tmp_path / "m"), vocab_size=40,
      minloglevel=0)
  assert _kinds(capfd.readouterr().err)["sentencepiece's own"] > 10

"""What several test modules share: the small built-in corpus (built once per test session, in
the same cache as tests/text/test_corpus.py) and a JSONL writer."""

import gzip
import json
import os

from segpack.text import corpus


def cache_dir(tmp_path_factory):
  """The run's small built-in corpus cache, built on first use; one for all xdist workers (their
  base temporary directories share a parent; `ensure_builtin` builds under a lock)."""
  base = tmp_path_factory.getbasetemp()
  cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "segpack-cache"
  corpus.ensure_builtin(size="small", cache_dir=cache, workers=1)
  return cache


def spm_model(tmp_path_factory):
  """The small built-in corpus's SentencePiece model file."""
  return corpus.ensure_builtin(size="small", cache_dir=cache_dir(tmp_path_factory),
                               workers=1).spm_model


def train_texts(count=120):
  """The first `count` documents of the small built-in corpus's train split."""
  return [t for _, t in corpus.builtin_documents(split="train", size="small")][:count]


def write_jsonl(path, records, *, gz=False):
  """`records` as JSON lines at `path` (gzipped with `gz`); returns `path`."""
  data = "".join(json.dumps(r) + "\n" for r in records).encode()
  path.write_bytes(gzip.compress(data) if gz else data)
  return path

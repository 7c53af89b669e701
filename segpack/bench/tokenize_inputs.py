"""What `segpack bench tokenize` measures on: the text, the tokenizers, the tokenizer alone.

- `build_corpus`: Python's standard-library sources (every `.py` file under this Python's
  `stdlib` directory, `site-packages` and `__pycache__` left out, files that are not UTF-8
  skipped), one JSONL record `{"text": ...}` per file in path order, the whole list repeated
  until the file holds `mb` MB: text that nobody here wrote.
- `train_tokenizers`: a SentencePiece model (`segpack.text.tokenizers.spm.train_spm`, segpack's
  settings; its first 300,000 lines) and a byte-level BPE `tokenizer.json` (the `tokenizers`
  library, the kind GPT-2 and Llama 3 ship), both of `vocab_size` pieces, trained on one pass of
  those sources (on less when the text is smaller).
- `alone`: the tokenizer without segpack. The texts are read into memory first (not timed), cut
  into the batches `segpack tokenize` would send its workers (`segpack.text.encode.chunk_texts`:
  about 1 MB each), and `procs` forked processes, each with its own tokenizer and an equal share
  of the text bytes, encode their batches with the library's batch call, keeping the ids:
  SentencePiece's `encode(texts)` (lists of ids; with `numpy_ids`, `encode(texts,
  return_type="numpy")`), Hugging Face's `encode_batch(texts, add_special_tokens=False)` and the
  `.ids` of each. The time runs from a barrier all of them wait at (tokenizer loaded) until the
  last one is done.

Both files and tokenizers are kept in the work directory and reused while their key (size,
vocabulary, this Python) is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece

from segpack import files
from segpack.text import encode
from segpack.text.corpus import stdlib_dir
from segpack.text.tokenizers import spm as spm_lib

__all__ = ["KINDS", "alone", "batch_call_name", "build_corpus", "stdlib_sources",
           "train_tokenizers"]

# Tokenizer kinds: a SentencePiece model, a Hugging Face tokenizer.json.
KINDS = ("spm", "hf")
# The SentencePiece trainer reads the first this many lines of the sources (about a third).
_SPM_SENTENCES = 300_000


def stdlib_sources() -> list[Path]:
  """The `.py` files of this Python's standard library, sorted by path (`site-packages` and
  `__pycache__` left out)."""
  root = stdlib_dir()
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
    found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
  return found


def _source_texts() -> list[str]:
  texts = []
  for path in stdlib_sources():
    try:
      texts.append(path.read_text("utf-8"))
    except (UnicodeDecodeError, OSError):
      continue
  return texts


def _key(**parts: Any) -> str:
  parts.update(python=sys.version, stdlib=str(stdlib_dir()))
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _cached(path: Path, key: str) -> dict[str, Any] | None:
  """The record beside `path` when it exists with `key` (and `path` too), else None."""
  try:
    record = json.loads(path.with_name(path.name + ".json").read_text("utf-8"))
  except (OSError, ValueError):
    return None
  return record if record.get("key") == key and path.exists() else None


def build_corpus(work_dir: Path, *, mb: float) -> dict[str, Any]:
  """The benchmark's JSONL file in `work_dir` (see the module docstring), written unless a file
  with the same key is there; returns its path, bytes, documents, source files and passes."""
  path = Path(work_dir) / "stdlib.jsonl"
  key = _key(mb=mb, what="corpus")
  record = _cached(path, key)
  if record is not None:
    return record
  texts = _source_texts()
  lines = [(json.dumps({"text": t}) + "\n").encode("utf-8") for t in texts]
  target, size, documents = int(mb * 1e6), 0, 0
  with open(path, "wb") as f:
    while size < target:
      for line in lines:
        f.write(line)
        size += len(line)
        documents += 1
        if size >= target:
          break
  record = {"key": key, "path": str(path), "bytes": size, "documents": documents,
            "source_files": len(texts), "passes": documents / len(texts)}
  files.atomic_write_json(path.with_name(path.name + ".json"), record)
  return record


def train_tokenizers(work_dir: Path, *, vocab_size: int, mb: float) -> dict[str, str]:
  """`{"spm": model file, "hf": tokenizer.json}` of `vocab_size` pieces, trained on one pass of
  the sources (or their first `mb` MB, when less) unless files with the same key are in
  `work_dir`."""
  work_dir = Path(work_dir)
  out = {"spm": work_dir / "spm.model", "hf": work_dir / "tokenizer.json"}
  key = _key(vocab_size=vocab_size, mb=mb, what="tokenizers")
  if _cached(out["spm"], key) and _cached(out["hf"], key):
    return {kind: str(p) for kind, p in out.items()}
  texts, size = [], 0
  for text in _source_texts():
    if size >= mb * 1e6:
      break
    texts.append(text)
    size += len(text)
  spm_lib.train_spm(texts, out["spm"], vocab_size=vocab_size, max_sentences=_SPM_SENTENCES)
  _train_bpe(texts, out["hf"], vocab_size=vocab_size)
  for p in out.values():
    files.atomic_write_json(p.with_name(p.name + ".json"), {"key": key})
  return {kind: str(p) for kind, p in out.items()}


def _train_bpe(texts: list[str], path: Path, *, vocab_size: int) -> None:
  """A byte-level BPE tokenizer.json (GPT-2's pre-tokenizer and decoder) trained on `texts`."""
  import tokenizers  # optional: the Hugging Face tokenizer needs the `segpack[hf]` extra
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  files.atomic_write_bytes(path, tok.to_str().encode("utf-8"))


def _batch_call(kind: str, tokenizer_file: str, numpy_ids: bool) -> Any:
  """The library's own batch call, alone: a function of a batch of texts to their ids."""
  if kind == "spm":
    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_file)
    if numpy_ids:
      return lambda texts: sp.encode(texts, return_type="numpy")
    return sp.encode
  import tokenizers  # optional: the Hugging Face tokenizer needs the `segpack[hf]` extra
  tok = tokenizers.Tokenizer.from_file(tokenizer_file)
  tok.no_truncation()
  tok.no_padding()
  tok.encode_special_tokens = True  # as segpack.text.tokenizers.hf.HfTokenizer encodes
  return lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def batch_call_name(kind: str, numpy_ids: bool = False) -> str:
  """What `alone` times for a tokenizer kind."""
  if kind == "spm":
    return ('SentencePieceProcessor.encode(texts, return_type="numpy")' if numpy_ids
            else "SentencePieceProcessor.encode(texts)")
  return "Tokenizer.encode_batch(texts, add_special_tokens=False), the .ids of each"


def _alone_worker(kind: str, tokenizer_file: str, numpy_ids: bool, batches: list[list[str]],
                  barrier: Any, results: Any) -> None:
  call = _batch_call(kind, tokenizer_file, numpy_ids)
  barrier.wait()
  wall, cpu = time.perf_counter(), time.process_time()
  ids = [call(batch) for batch in batches]
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  results.put((wall, cpu, sum(len(x) for batch_ids in ids for x in batch_ids)))


def alone(kind: str, tokenizer_file: str, corpus: str, *, procs: int,
          numpy_ids: bool = False) -> dict[str, Any]:
  """The tokenizer alone on the corpus in `procs` processes (module docstring): seconds, the
  processes' CPU seconds while encoding, tokens, and the call that was timed. `numpy_ids`:
  SentencePiece's ids as NumPy arrays (`return_type="numpy"`, SentencePiece 0.2.1 and later; the
  call segpack's workers make) instead of its default, lists of ints."""
  with open(corpus, "rb") as f:
    batches = [batch for batch, _ in encode.chunk_texts(json.loads(line)["text"] for line in f)]
  sizes = np.cumsum([sum(len(t) for t in batch) for batch in batches])
  cuts = np.searchsorted(sizes, sizes[-1] * np.arange(1, procs) / procs).tolist()
  shares = [batches[a:b] for a, b in zip([0] + cuts, cuts + [len(batches)])]
  ctx = multiprocessing.get_context("fork")  # the texts are shared, not copied
  barrier, results = ctx.Barrier(procs + 1), ctx.SimpleQueue()
  workers = [ctx.Process(target=_alone_worker, args=(kind, tokenizer_file, numpy_ids, share,
                                                     barrier, results)) for share in shares]
  for w in workers:
    w.start()
  barrier.wait()
  started = time.perf_counter()
  done = [results.get() for _ in workers]
  seconds = time.perf_counter() - started
  for w in workers:
    w.join()
  return {"seconds": seconds, "cpu_seconds": sum(d[1] for d in done),
          "tokens": sum(d[2] for d in done), "call": batch_call_name(kind, numpy_ids),
          "process_seconds": [d[0] for d in done]}


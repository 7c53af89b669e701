"""SentencePiece: deterministic training, a small tokenizer wrapper, and the cache directory.

Training settings aim at an exact round trip of both prose and source code:

* `normalization_rule_name="identity"`, `remove_extra_whitespaces=False`, `add_dummy_prefix=False`:
  no Unicode normalisation, no whitespace collapsing, no leading space added;
* `"\\n"` and `"\\t"` are user-defined symbols (always one piece each) and
  `allow_whitespace_only_pieces=True` lets runs of spaces (indentation) become single pieces;
* `byte_fallback=True`: any character outside the vocabulary is spelled as UTF-8 byte pieces, so
  no text ever maps to `<unk>`.

With these, `decode(encode(text)) == text` for every text that does not contain U+2581 ("▁",
SentencePiece's internal space marker, which decodes as a plain space); that is the only
normalisation left. Reserved ids: pad=0 (packed rows put 0 on padding), unk=1, bos=2, eos=3.

Training is deterministic: the input sentences are the first `max_sentences` non-blank lines in
input order (no sampling) and the thread count is fixed (SentencePiece's result depends on it), so
the same text and settings give a byte-identical model file (the sentences are streamed from an
iterator and the model returned in memory, so it records no temporary paths either).
"""

from __future__ import annotations

import inspect
import io
import itertools
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece

from segpack import files
from segpack import shards
from segpack.errors import ArgumentError
from segpack.text.tokenizers import spm_proto

_LOG = logging.getLogger(__name__)
# SentencePiece's error when vocab_size is below the pieces every character needs.
_REQUIRED_PIECES = re.compile(r"smaller than required_chars\. (\d+) vs (\d+)")


__all__ = ["NUMPY_IDS", "SpmTokenizer", "cache_root", "train_spm", "PAD_ID", "UNK_ID", "BOS_ID",
           "EOS_ID"]

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# SentencePiece's unigram trainer gives different models for different thread counts: fixed.
TRAIN_THREADS = 4
# Lines longer than this (in bytes) are left out of training (they are still encoded).
MAX_SENTENCE_BYTES = 16384
# SentencePiece 0.2.1 and later hand a batch's ids over as NumPy arrays (`return_type="numpy"`),
# without a Python int per id.
NUMPY_IDS = "return_type" in inspect.signature(
    sentencepiece.SentencePieceProcessor.Encode).parameters


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
  """The cache directory: `cache_dir`, else `$SEGPACK_CACHE`, else `~/.cache/segpack`."""
  if cache_dir is not None:
    return Path(cache_dir).expanduser()
  env = os.environ.get("SEGPACK_CACHE")
  if env:
    return Path(env).expanduser()
  return Path("~/.cache/segpack").expanduser()


class SpmTokenizer:
  """A SentencePiece model with segpack's id conventions.

  Algorithm:
    1. Load: the model file's SHA-256 becomes `fingerprint` (shard manifests record it, so
       tokens are never decoded with another model); the reserved ids are read from the model.
    2. `encode`: SentencePiece segments the text into the most likely pieces (spaces are the
       marker "▁", characters outside the vocabulary become UTF-8 byte pieces) and the ids are
       returned as a NumPy array in the shard dtype. No BOS/EOS is added.
    3. `decode`: ids back to pieces, byte pieces back to characters, "▁" back to spaces; the
       control ids (pad, bos, eos) decode to nothing.

  Example: with the built-in 8k model, `tok.encode("    return x\\n")` is the pieces
  ["▁▁▁▁", "return", "▁", "x", "\\n"] and `tok.decode` of their ids gives the text back.
  """

  def __init__(self, model_file: str | os.PathLike[str]):
    """Loads a SentencePiece model file; raises FileNotFoundError / ValueError naming it."""
    self.model_file = Path(model_file)
    if not self.model_file.is_file():
      raise FileNotFoundError(f"SentencePiece model {str(self.model_file)!r} does not exist")
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.model_file))
    except (RuntimeError, OSError) as e:
      raise ArgumentError(f"{self.model_file}: not a SentencePiece model ({e})") from e
    self.fingerprint = "sha256:" + files.sha256_file(self.model_file)
    # `segpack.text.tokenizers.spec.from_spec(spec)` rebuilds this tokenizer (worker processes).
    self.spec = "spm:" + str(self.model_file.resolve())
    self.vocab_size: int = self._sp.get_piece_size()
    self.pad_id: int = self._sp.pad_id()
    self.unk_id: int = self._sp.unk_id()
    self.bos_id: int = self._sp.bos_id()
    self.eos_id: int = self._sp.eos_id()
    self.dtype = shards.dtype_for_vocab(self.vocab_size)
    self._user_defined: dict[str, int] | None = None

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text` (no BOS/EOS: the packing pipeline adds those) in the shard dtype."""
    return np.asarray(self._sp.encode(text), dtype=self.dtype)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` of each text."""
    if NUMPY_IDS:
      return [ids.astype(self.dtype) for ids in self._sp.encode(list(texts), return_type="numpy")]
    return [np.asarray(ids, dtype=self.dtype) for ids in self._sp.encode(list(texts))]

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """The text of token ids; pad/bos/eos ids decode to nothing."""
    return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])

  def id_to_piece(self, token_id: int) -> str:
    return self._sp.id_to_piece(int(token_id))

  def symbol_id(self, piece: str) -> int | None:
    """The id of `piece` when it is a user-defined symbol of the model (always encoded as that
    one piece, whatever surrounds it), else None."""
    if self._user_defined is None:
      self._user_defined = spm_proto.user_defined_pieces(self.model_file.read_bytes())
    return self._user_defined.get(piece)

  def describe(self) -> dict[str, Any]:
    """JSON-ready description (the shard manifest's `metadata.tokenizer`, read back as a
    `segpack.shards.record.TokenizerRecord`)."""
    return {"type": "sentencepiece", "model_file": self.model_file.name,
            "fingerprint": self.fingerprint, "vocab_size": self.vocab_size,
            "pad_id": self.pad_id, "unk_id": self.unk_id, "bos_id": self.bos_id,
            "eos_id": self.eos_id}

  def __repr__(self) -> str:
    return f"SpmTokenizer({str(self.model_file)!r}, vocab_size={self.vocab_size})"


def _training_sentences(texts: Iterable[str], max_sentences: int) -> Iterator[str]:
  """The first `max_sentences` non-blank lines of `texts` (longer lines left out)."""
  count = 0
  for text in texts:
    for line in text.split("\n"):
      if line.strip() and len(line.encode("utf-8")) <= MAX_SENTENCE_BYTES:
        yield line
        count += 1
        if count >= max_sentences:
          return


def train_spm(
    texts: Iterable[str],
    model_file: str | os.PathLike[str],
    *,
    vocab_size: int,
    max_sentences: int = 4_000_000,
    model_type: str = "unigram",
    user_defined_symbols: Sequence[str] = (),
    progress: bool = False,
) -> SpmTokenizer:
  """Trains a SentencePiece model on `texts` and writes it atomically to `model_file`.

  Args:
    texts: documents; their non-blank lines are the training sentences.
    model_file: where the `.model` file goes (its directory is created).
    vocab_size: number of pieces, including the 4 reserved ids and 256 byte pieces.
    max_sentences: train on the first this many lines (deterministic, no sampling).
    model_type: "unigram" or "bpe".
    user_defined_symbols: extra strings that always become one piece each (e.g. the chat role
      markers of `segpack.text.chat`); they get the ids right after "\\n" and "\\t" (6, 7, ...).
    progress: say on stderr when training starts (it takes minutes on a large corpus, and
      SentencePiece itself is silent) and how long it took.

  Returns:
    The trained tokenizer.
  """
  if not isinstance(vocab_size, int) or vocab_size < 300:
    raise ArgumentError(f"train_spm: vocab_size must be an int >= 300 (4 reserved ids + 256 byte "
                     f"pieces + some), got {vocab_size!r}")
  symbols = list(user_defined_symbols)
  if any(not isinstance(x, str) or not x for x in symbols) or len(set(symbols)) != len(symbols):
    raise ArgumentError(f"train_spm: user_defined_symbols must be distinct non-empty strings, got "
                     f"{symbols!r}")
  model_file = Path(model_file)
  model_file.parent.mkdir(parents=True, exist_ok=True)
  sentences = _training_sentences(texts, max_sentences)
  first = next(sentences, None)
  if first is None:
    raise ArgumentError(f"train_spm: no non-blank text to train {model_file} on")
  model = io.BytesIO()
  raised: list[BaseException] = []
  started = time.perf_counter()
  if progress:
    print(f"segpack: training a SentencePiece model ({vocab_size} pieces) into {model_file} on "
          f"the input's lines (up to {max_sentences:,}; minutes on a large corpus)",
          file=sys.stderr, flush=True)
  # Sentences from an iterator and the model into memory: the model file then records no
  # temporary paths in its trainer spec, so it is byte-identical from run to run.
  try:
    _train(_reraisable(itertools.chain([first], sentences), raised), model,
           vocab_size=vocab_size, model_type=model_type,
           user_defined_symbols=["\n", "\t"] + [x for x in symbols if x not in ("\n", "\t")])
    failure = None
  except RuntimeError as e:
    failure = e
  if raised:  # The texts' own error (a bad input record, Ctrl-C), as itself.
    raise raised[0]
  if failure is not None:
    needed = _REQUIRED_PIECES.search(str(failure))
    if needed:
      raise ArgumentError(
          f"train_spm: vocab_size={vocab_size} is smaller than the {needed.group(2)} pieces the "
          f"text of {model_file} needs (4 reserved ids, 256 byte pieces, the user-defined "
          "symbols and one piece per character of 99.95% of the text): pass a vocab_size "
          f"(--vocab-size) of at least {needed.group(2)}") from failure
    raise ArgumentError(f"train_spm: SentencePiece could not train {model_file}: {failure}"
                     ) from failure
  files.atomic_write_bytes(model_file, model.getvalue())
  tokenizer = SpmTokenizer(model_file)
  if progress:
    print(f"segpack: trained the SentencePiece model in {time.perf_counter() - started:.1f} s",
          file=sys.stderr, flush=True)
  if tokenizer.vocab_size < vocab_size:  # hard_vocab_limit=False: the text had fewer pieces
    _LOG.warning("trained a %d-piece SentencePiece model, fewer than the %d asked for: the text "
                 "holds no more pieces; the dataset's vocab_size is %d", tokenizer.vocab_size,
                 vocab_size, tokenizer.vocab_size)
  return tokenizer


def _reraisable(sentences: Iterator[str], raised: list[BaseException]) -> Iterator[str]:
  """`sentences`, keeping what it raises in `raised`: SentencePiece turns an exception raised
  by its sentence iterator into a RuntimeError ("INTERNAL: ..."), and `train_spm` raises the
  original instead (an InputFormatError naming the file and line stays one)."""
  try:
    yield from sentences
  except BaseException as e:
    raised.append(e)
    raise


def _train(sentences: Iterator[str], model: io.BytesIO, *, vocab_size: int, model_type: str,
           user_defined_symbols: list[str]) -> None:
  """SentencePieceTrainer.train with segpack's settings (see the module docstring)."""
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=sentences, model_writer=model,
      vocab_size=vocab_size, model_type=model_type, character_coverage=0.9995,
      byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
      add_dummy_prefix=False, split_by_whitespace=True, allow_whitespace_only_pieces=True,
      user_defined_symbols=user_defined_symbols,
      pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, num_threads=TRAIN_THREADS,
      shuffle_input_sentence=False, input_sentence_size=0, max_sentence_length=MAX_SENTENCE_BYTES,
      minloglevel=2,
      hard_vocab_limit=False)

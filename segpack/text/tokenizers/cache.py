"""SentencePiece models trained on first use and cached, and kept from being replaced under a
dataset that uses them.

A trained model sits beside a JSON record of the key it was trained with (the inputs' identity and
the vocabulary size); the same key reuses it. A model that a finished dataset beside it was
tokenized with is never retrained or replaced without `overwrite`: the dataset would otherwise be
left with a model that no longer matches its `tokenizer_fingerprint`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from segpack import files
from segpack import remote_files
from segpack import shards as shards_lib
from segpack.text.encode import counted, resume_key
from segpack.text.inputs import InputFormatError
from segpack.text.tokenizers import spec as tokenizer_spec
from segpack.text.tokenizers import spm as spm_lib

__all__ = ["copy_model", "keep_tokenizer", "model_entry", "refuse_to_replace_model",
           "trained_tokenizer"]

_LOG = logging.getLogger(__name__)


def refuse_to_replace_model(model_file: Path, datasets: Sequence[Path], *,
                             overwrite: bool) -> None:
  """Raises before `model_file` is (re)written while a finished dataset beside it uses it.

  Without this, a rerun with other inputs or settings retrains (or copies) the model first and
  only then finds the dataset and refuses: the old dataset would be left with a model that no
  longer matches its `tokenizer_fingerprint`.
  """
  if overwrite:
    return
  for dataset in datasets:
    if (dataset / shards_lib.MANIFEST_NAME).exists():
      raise InputFormatError(
          f"output={str(dataset)!r} (--output) already holds a dataset made from other inputs "
          f"or settings (its tokenizer {str(model_file)!r} would be replaced); pass "
          f"overwrite=True (--overwrite) to replace it")


def trained_tokenizer(texts: Iterable[str], model_file: Path, *, vocab_size: int,
                       key: dict[str, Any], protect: Sequence[Path] = (),
                       overwrite: bool = True, progress: bool = False) -> spm_lib.SpmTokenizer:
  """Trains (or, when `model_file` was trained with the same `key`, reuses) a model.

  `protect`: dataset directories that use `model_file`; unless `overwrite`, training is refused
  while one of them holds a finished dataset (see `_refuse_to_replace_model`). `progress`: say on
  stderr what the training is doing (it is silent for a minute or more otherwise): one line as it
  starts and one as it ends (`train_spm`'s), instead of the INFO log records of these.
  """
  record = model_file.with_suffix(".json")
  key_hash = resume_key(dict(key, vocab_size=vocab_size))
  if model_file.exists() and record.exists():
    try:
      if json.loads(record.read_text("utf-8")).get("key") == key_hash:
        return spm_lib.SpmTokenizer(model_file)
    except ValueError:
      pass
  refuse_to_replace_model(model_file, protect, overwrite=overwrite)
  record.unlink(missing_ok=True)
  # One line when training starts and one when it ends: `train_spm`'s own with `progress`, else
  # a log record (the command line and the trainer print segpack's INFO records too: both would
  # say each thing twice).
  if not progress:
    _LOG.info("training a SentencePiece model (%d pieces) into %s", vocab_size, model_file)
  start = time.perf_counter()
  tokenizer = spm_lib.train_spm(counted(texts, progress, "read for the tokenizer"), model_file,
                                vocab_size=vocab_size, progress=progress)
  files.atomic_write_json(record, {"key": key_hash, "vocab_size": vocab_size,
                                         "fingerprint": tokenizer.fingerprint})
  if not progress:
    _LOG.info("trained %s in %.1f s", model_file, time.perf_counter() - start)
  return tokenizer


def copy_model(tokenizer: spm_lib.SpmTokenizer, output: Path, *,
                overwrite: bool) -> spm_lib.SpmTokenizer:
  """Copies the model to `output/spm.model` (atomically) unless it already is that file (and
  refuses to replace the model of finished `output/train`, `output/eval` without `overwrite`)."""
  target = output / "spm.model"
  if target.exists() and files.sha256_file(target) == tokenizer.fingerprint.split(":", 1)[1]:
    return spm_lib.SpmTokenizer(target)
  refuse_to_replace_model(target, [output / "train", output / "eval"], overwrite=overwrite)
  output.mkdir(parents=True, exist_ok=True)
  files.atomic_write_bytes(target, tokenizer.model_file.read_bytes())
  return spm_lib.SpmTokenizer(target)


def keep_tokenizer(tokenizer: tokenizer_spec.Tokenizer, output: Path) -> None:
  """Copies the tokenizer's files (a SentencePiece model; a `tokenizer.json` and the
  `tokenizer_config.json` beside it) into the finished dataset under the names its manifest
  records (`metadata.tokenizer.model_file`, `config_file`), so that training, sampling and export
  never depend on a path outside the dataset. Atomic per file; a copy already equal is kept."""
  if remote_files.is_url(str(output)):
    return  # a dataset at a URL: its tokenizer stays where --tokenizer / --spm-model named it
  sources = [getattr(tokenizer, "model_file", None), getattr(tokenizer, "config_file", None)]
  for src in (Path(p) for p in sources if p is not None):
    dest = output / src.name
    if dest.exists() and (dest.resolve() == src.resolve()
                          or files.sha256_file(dest) == files.sha256_file(src)):
      continue
    files.atomic_write_bytes(dest, src.read_bytes())


def model_entry(tokenizer: tokenizer_spec.Tokenizer) -> dict[str, str]:
  """The manifest metadata entry naming the tokenizer's file."""
  key = "spm_model" if isinstance(tokenizer, spm_lib.SpmTokenizer) else "tokenizer_file"
  return {key: str(getattr(tokenizer, "model_file", tokenizer.spec))}

"""Where the trainer's documents come from (`train.data`): a dataset written by `segpack
tokenize` (`data.train`, one dataset or a mixture, with `data.eval` or a held-out share of its
documents), the built-in corpus, the built-in chat corpus or synthetic documents; with each
source, its vocabulary, special ids and tokenizer fingerprint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from segpack import shards
from segpack.data import sources as sources_lib
from segpack.data import subset
from segpack.data.mixture import Mixture, parse_data
from segpack.data.options import PipelineConfigError
from segpack.errors import UserError
from segpack.text.chat import corpus as chat_corpus
from segpack.text import corpus
from segpack.text.tokenizers import spm
from train import config_checks

SYNTHETIC_BOS, SYNTHETIC_EOS = 1, 2


class DataConfigError(UserError, ValueError):
  """The `data` / `packing` config groups describe no usable data."""


def synthetic_documents(*, num_docs: int, mean_len: int, vocab: int, seed: int) -> list[np.ndarray]:
  """Random documents with log-normal lengths (a long tail, like real text), ids in [3, vocab)."""
  rng = np.random.default_rng(seed)
  lengths = np.clip(rng.lognormal(np.log(mean_len), 1.0, size=num_docs), 1, 20 * mean_len)
  return [rng.integers(3, vocab, size=int(n), dtype=np.int32) for n in lengths]


def open_dataset(key: str, path: str) -> shards.ShardSource:
  try:
    return shards.ShardSource(path)
  except (OSError, shards.ShardFormatError) as e:
    raise DataConfigError(f"{key}={path!r} could not be opened as a dataset: {e}") from e


def pad_id(source: Any) -> dict[str, int]:
  """`{"pad_id": id}` when the record of the dataset `source` reads gives a pad id (its
  tokenizer's), else {}."""
  record = sources_lib.dataset_record(source)
  pad = None if record is None else record.special_id("pad_id")
  return {} if pad is None else dict(pad_id=int(pad))


def _mixture(config: Any) -> Mixture | None:
  """`data.train` as a `Mixture`, or None for one dataset (`segpack.data.mixture.parse_data`)."""
  try:
    mixture = parse_data(config.data.train, tokens_per_epoch=config.data.tokens_per_epoch)
  except PipelineConfigError as e:
    raise DataConfigError(f"data.train={config.data.train!r}: {e}") from e
  if mixture is None:
    if config.data.tokens_per_epoch is not None:
      raise DataConfigError(
          f"data.tokens_per_epoch={config.data.tokens_per_epoch} is for a mixture data.train "
          f"('name=path:weight,...'), got the single dataset {config.data.train!r}")
    return None
  return mixture


def _mixture_sources(config: Any,
                     mixture: Mixture) -> tuple[Any, Any, int, dict[str, int], str]:
  """A mixture `data.train`: each source split by `held_out_split` (or `data.eval`); the
  held-out documents of all sources are evaluated together."""
  opened = [open_dataset(f"data.train source {m.name!r}", m.source) for m in mixture.sources]
  if config.data.eval is not None or config.data.eval_share == 0:  # data.eval_share=0: no held-out data
    held_out = None if config.data.eval is None else open_dataset("data.eval", config.data.eval)
    train_parts = opened
  else:
    try:
      splits = [subset.held_out_split(src, share=config.data.eval_share) for src in opened]
    except PipelineConfigError as e:
      raise DataConfigError(f"data.eval_share={config.data.eval_share!r} with data.train: {e}") from e
    train_parts = [t for t, _ in splits]
    held_out = subset.DocumentSubset(
        opened, ids=np.concatenate([h.parent_ids for _, h in splits]),
        parent_index=np.repeat(np.arange(len(splits)), [len(h) for _, h in splits]),
        name=f"held_out{config.data.eval_share}")
  train = Mixture(sources=tuple(dataclasses.replace(m, source=part)
                                for m, part in zip(mixture.sources, train_parts)),
                  tokens_per_epoch=mixture.tokens_per_epoch, segment_sources=True)
  return (train, held_out, max(int(src.vocab_size) for src in opened), pad_id(opened[0]),
          opened[0].tokenizer_fingerprint)


def open_eval(config: Any, train: Any) -> shards.ShardSource:
  """`data.eval` opened, refused unless tokenized as `train` (the opened `data.train`) was."""
  held_out = open_dataset("data.eval", config.data.eval)
  if held_out.tokenizer_fingerprint != train.tokenizer_fingerprint:
    raise DataConfigError(
        f"data.train={config.data.train!r} (tokenizer {train.tokenizer_fingerprint}) and "
        f"data.eval={config.data.eval!r} (tokenizer {held_out.tokenizer_fingerprint}) were "
        f"tokenized differently; tokenize both with one tokenizer (segpack tokenize --spm-model "
        f"...)")
  return held_out


def _dataset_sources(config: Any) -> tuple[Any, Any, int, dict[str, int], str]:
  """`data.train` (and `data.eval`, or its held-out share): ids and vocabulary from the manifest."""
  mixture = _mixture(config)
  if mixture is not None:
    return _mixture_sources(config, mixture)
  train = open_dataset("data.train", config.data.train)
  if config.data.eval is not None:
    held_out = open_eval(config, train)
  elif config.data.eval_share == 0:  # train on every document; no evaluation
    held_out = None
  else:
    try:
      train, held_out = subset.held_out_split(train, share=config.data.eval_share)
    except PipelineConfigError as e:
      raise DataConfigError(f"data.eval_share={config.data.eval_share!r} with data.train: {e}") from e
  # BOS/EOS: from the manifest's record, read by the pipeline
  return train, held_out, int(train.vocab_size), pad_id(train), train.tokenizer_fingerprint


def sources(config: Any) -> tuple[Any, Any, int, dict[str, int], str | None]:
  """`(train, held_out, vocab_size, special ids, tokenizer fingerprint)` of the configured
  data; the fingerprint is a `segpack tokenize` dataset's (None for the built-in sources)."""
  if config.data.train is not None:
    return _dataset_sources(config)
  if config.data.source == "synthetic":
    train = synthetic_documents(num_docs=config.data.synthetic_docs, mean_len=config.data.synthetic_mean_len,
                                vocab=config.data.synthetic_vocab, seed=config.data.seed)
    held_out = synthetic_documents(num_docs=max(config.data.synthetic_docs // 20, 8),
                                   mean_len=config.data.synthetic_mean_len, vocab=config.data.synthetic_vocab,
                                   seed=config.data.seed + 1)
    ids = dict(bos_id=SYNTHETIC_BOS, eos_id=SYNTHETIC_EOS)
    return train, held_out, config.data.synthetic_vocab, ids, None
  if config.data.source == "builtin":
    built = corpus.ensure_builtin(size=config.data.size, cache_dir=config.data.cache_dir, progress=True)
    tok = spm.SpmTokenizer(built.spm_model)
    ids = dict(bos_id=int(tok.bos_id), eos_id=int(tok.eos_id))
    return str(built.train_dir), str(built.eval_dir), int(built.vocab_size), ids, None
  if config.data.source == "builtin_chat":
    built = chat_corpus.ensure_builtin_chat(size=config.data.size, train_on=config.data.train_on,
                                            cache_dir=config.data.cache_dir)
    tok = spm.SpmTokenizer(built.spm_model)
    ids = dict(bos_id=tok.bos_id, eos_id=tok.eos_id)
    return str(built.train_dir), str(built.eval_dir), int(built.vocab_size), ids, None
  raise DataConfigError(
      f"data.source must be one of {list(config_checks.SOURCES)}, got {config.data.source!r}")

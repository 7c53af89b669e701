"""Training and evaluation batches for the trainer, from the built-in corpus or synthetic documents.

Each process reads only its own rows (`pack_dataset(shard_index=process_index,
shard_count=process_count)`) and batches them to `batch_size / process_count` rows; the step
function assembles the global batch with `jax.make_array_from_process_local_data`. The training
set is an infinite `grain.MapDataset` of batches, so its position is one integer, which Grain's
`DatasetIterator.get_state()` exposes and the checkpoint stores.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import grain
import numpy as np

from segpack import pipeline

SYNTHETIC_BOS, SYNTHETIC_EOS = 1, 2


class DataConfigError(ValueError):
  """The `data` / `packing` config groups describe no usable data."""


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """What the trainer needs from the `data` and `packing` config groups (plain typed values)."""

  source: str  # "builtin" or "synthetic"
  size: str  # builtin corpus size: "full" or "small"
  cache_dir: str | None
  seq_len: int
  strategy: str
  long_docs: str
  max_segments_per_row: int | None
  add_bos: bool
  add_eos: bool
  seed: int
  synthetic_docs: int
  synthetic_mean_len: int
  synthetic_vocab: int

  @classmethod
  def from_config(cls, config: Any) -> "DataSpec":
    d, p = config.data, config.packing
    return cls(source=d.source, size=d.size, cache_dir=d.cache_dir, seq_len=p.seq_len,
               strategy=p.strategy, long_docs=p.long_docs,
               max_segments_per_row=p.max_segments_per_row, add_bos=d.add_bos,
               add_eos=d.add_eos, seed=d.seed, synthetic_docs=d.synthetic_docs,
               synthetic_mean_len=d.synthetic_mean_len, synthetic_vocab=d.synthetic_vocab)


@dataclasses.dataclass
class Data:
  """Per-process batches.

  Attributes:
    train: infinite `MapDataset` of training batches (element `i` = the batch of step `i + 1`).
    eval: finite `MapDataset` of held-out batches (one pass).
    vocab_size: tokenizer vocabulary size.
    train_rows_per_epoch: rows this process reads per epoch.
    description: a one-line summary for the log.
  """

  train: grain.MapDataset
  eval: grain.MapDataset
  vocab_size: int
  train_rows_per_epoch: int
  description: str


def synthetic_documents(*, num_docs: int, mean_len: int, vocab: int, seed: int) -> list[np.ndarray]:
  """Random documents with log-normal lengths (a long tail, like real text), ids in [3, vocab)."""
  rng = np.random.default_rng(seed)
  lengths = np.clip(rng.lognormal(np.log(mean_len), 1.0, size=num_docs), 1, 20 * mean_len)
  return [rng.integers(3, vocab, size=int(n), dtype=np.int32) for n in lengths]


def _sources(spec: DataSpec) -> tuple[Any, Any, int, dict[str, int]]:
  if spec.source == "synthetic":
    train = synthetic_documents(num_docs=spec.synthetic_docs, mean_len=spec.synthetic_mean_len,
                                vocab=spec.synthetic_vocab, seed=spec.seed)
    held_out = synthetic_documents(num_docs=max(spec.synthetic_docs // 20, 8),
                                   mean_len=spec.synthetic_mean_len, vocab=spec.synthetic_vocab,
                                   seed=spec.seed + 1)
    return train, held_out, spec.synthetic_vocab, dict(bos_id=SYNTHETIC_BOS, eos_id=SYNTHETIC_EOS)
  if spec.source == "builtin":
    from segpack import corpus  # pylint: disable=g-import-not-at-top
    import sentencepiece  # pylint: disable=g-import-not-at-top
    built = corpus.ensure_builtin(size=spec.size, cache_dir=spec.cache_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(built.spm_model))
    ids = dict(bos_id=int(sp.bos_id()), eos_id=int(sp.eos_id()))
    return str(built.train_dir), str(built.eval_dir), int(built.vocab_size), ids
  raise DataConfigError(f"data.source must be 'builtin' or 'synthetic', got {spec.source!r}")


def make_data(spec: DataSpec, *, batch_size: int, process_index: int,
              process_count: int) -> Data:
  """Packs the train and held-out splits and batches this process's rows.

  Args:
    spec: data and packing settings.
    batch_size: rows per step over all processes (divisible by `process_count`).
    process_index: this process (`jax.process_index()`).
    process_count: number of processes (`jax.process_count()`).
  """
  if batch_size % process_count:
    raise DataConfigError(
        f"train.batch_size={batch_size} is not divisible by the {process_count} processes")
  local = batch_size // process_count
  train_src, eval_src, vocab, ids = _sources(spec)
  common = dict(seq_len=spec.seq_len, strategy=spec.strategy, long_docs=spec.long_docs,
                add_bos=spec.add_bos, add_eos=spec.add_eos,
                max_segments_per_row=spec.max_segments_per_row, shard_index=process_index,
                shard_count=process_count, **ids)
  train_rows = pipeline.pack_dataset(train_src, seed=spec.seed, shuffle=True, num_epochs=None,
                                     **common)
  eval_rows = pipeline.pack_dataset(eval_src, shuffle=False, num_epochs=1, **common)
  return Data(
      train=train_rows.batch(local, drop_remainder=True),
      eval=eval_rows.batch(local, drop_remainder=False),
      vocab_size=vocab, train_rows_per_epoch=train_rows.rows_per_epoch,
      description=(f"{spec.source} data, {spec.strategy} packing, seq_len {spec.seq_len}: "
                   f"{train_rows.num_plan_rows} train rows/epoch, {eval_rows.num_plan_rows} "
                   f"eval rows, vocab {vocab}"))


def pad_batch(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  """Pads a short (last) eval batch with all-padding rows to `rows` rows."""
  n = len(batch["input_ids"])
  if n == rows:
    return batch
  out = {}
  for key, value in batch.items():
    fill = -100 if key == "labels" else 0
    out[key] = np.concatenate([value, np.full((rows - n,) + value.shape[1:], fill, value.dtype)])
  return out


def fingerprint(batch: dict[str, np.ndarray]) -> tuple[str, list[str]]:
  """A hash of the whole batch and a short hash per row (to compare runs and processes)."""
  rows = []
  whole = hashlib.sha256()
  for r in range(len(batch["input_ids"])):
    h = hashlib.sha256()
    for key in ("input_ids", "labels", "segment_ids", "segment_positions"):
      h.update(np.ascontiguousarray(batch[key][r]).tobytes())
    rows.append(h.hexdigest()[:16])
    whole.update(h.digest())
  return whole.hexdigest()[:16], rows

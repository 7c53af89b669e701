"""The trainer's batches of preference pairs (`preference.loss` other than "none").

`data.train` is a preference dataset (`segpack tokenize --format preference`); the held-out
pairs are `data.eval`'s, or `data.eval_share` of the pairs (whole pairs, never one sequence of
one). Rows come from `segpack.data.pairs.pack_pairs`, one plan per run, served by `StreamBatches` as
any rows (epochs, process blocks, resuming). `make_preference_data` also returns, for the
reference's scoring pass, one unshuffled epoch of each split (`Splits`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from segpack import shards
from segpack.data import pairs as pairs_lib
from segpack.data import subset
from segpack.data.options import PipelineConfigError, SpecialTokens
from segpack.data.stream import StreamBatches
from segpack.packing.options import PlanOptions
from segpack.packing.pairs import PairTooLongError
from train import data_sources as data_sources
from train import data as data_lib

__all__ = ["Splits", "make_preference_data"]


@dataclasses.dataclass
class Splits:
  """The pair datasets of a run, by split ("train", "eval"): `rows[s]` the stream the run reads
  (the training one infinite and shuffled), `once[s]` one unshuffled epoch (scoring),
  `fingerprints[s]` the data each holds, `num_pairs[s]` its pairs, and `parents[s]` its
  dataset's fingerprint with the dataset's pair index of each of its pairs."""

  rows: dict[str, Any]
  once: dict[str, Any]
  fingerprints: dict[str, str]
  num_pairs: dict[str, int]
  parents: dict[str, tuple[str, np.ndarray]]


def _sources(config: Any) -> tuple[Any, Any, shards.ShardSource]:
  """`(train pairs, held-out pairs or None, the opened data.train)`."""
  if config.data.train is None or "=" in config.data.train:  # none, or a mixture
    raise data_sources.DataConfigError(
        f"preference.loss={config.preference.loss!r} trains on the pairs of one preference "
        f"dataset: set data.train to a directory written by `segpack tokenize --format "
        f"preference`, got data.train={config.data.train!r}")
  opened = data_sources.open_dataset("data.train", config.data.train)
  if config.data.eval is not None:
    return opened, data_sources.open_eval(config, opened), opened
  if config.data.eval_share == 0:
    return opened, None, opened
  try:
    train, held = pairs_lib.held_out_pairs(opened, share=config.data.eval_share)
  except PipelineConfigError as e:
    raise data_sources.DataConfigError(f"data.eval_share={config.data.eval_share!r}: {e}") from e
  return train, held, opened


def _parent(src: Any) -> tuple[int, tuple[str, np.ndarray]]:
  """A split's pairs, and its dataset's fingerprint with the dataset's index of each pair."""
  if isinstance(src, subset.DocumentSubset):
    ids = np.asarray(src.parent_ids[0::2], np.int64) // 2
    return ids.size, (str(src.parent.fingerprint), ids)
  n = len(src) // 2
  return n, (str(src.fingerprint), np.arange(n))


def _pack(config: Any, source: Any, key: str, *, shuffle: bool, num_epochs: int | None,
          special: SpecialTokens):
  p = config.preference
  try:
    return pairs_lib.pack_pairs(
        source, plan=PlanOptions(seq_len=config.packing.seq_len, strategy=config.packing.strategy),
        seed=config.data.seed, shuffle=shuffle, num_epochs=num_epochs, special_tokens=special,
        shared_prefix=bool(p.shared_prefix), truncate=bool(p.truncate))
  except pairs_lib.NotPreferenceDataError as e:
    raise data_sources.DataConfigError(
        f"preference.loss={p.loss!r} with {key}={getattr(config.data, key.split('.')[-1])!r}: "
        f"{e}") from e
  except PipelineConfigError as e:
    raise data_lib.special_ids_error(config, e) or e
  except PairTooLongError as e:
    raise data_sources.DataConfigError(f"{key}: {e} (packing.seq_len, preference.truncate)") from e


def make_preference_data(config: Any, *, batch_size: int, process_index: int,
                         process_count: int) -> tuple[data_lib.Data, Splits]:
  """The run's `Data` over pair rows and its `Splits` (refusing what pairs cannot do)."""
  if batch_size % process_count:
    raise data_sources.DataConfigError(
        f"train.batch_size={batch_size} is not divisible by the {process_count} processes")
  train_src, eval_src, opened = _sources(config)
  ids = data_sources.pad_id(opened)
  special = SpecialTokens(add_bos=config.data.add_bos, add_eos=config.data.add_eos, **ids)
  layout = dict(global_batch_size=batch_size, process_index=process_index,
                process_count=process_count)
  splits = Splits(rows={}, once={}, fingerprints={}, num_pairs={}, parents={})
  for name, src in (("train", train_src), ("eval", eval_src)):
    if src is None:
      continue
    key = "data.train" if name == "train" or config.data.eval is None else "data.eval"
    splits.once[name] = _pack(config, src, key, shuffle=False, num_epochs=1, special=special)
    splits.fingerprints[name] = str(getattr(src, "fingerprint", ""))
    splits.num_pairs[name], splits.parents[name] = _parent(src)
  splits.rows["train"] = _pack(config, train_src, "data.train", shuffle=True, num_epochs=None,
                               special=special)
  if "eval" in splits.once:
    splits.rows["eval"] = splits.once["eval"]
  rows = splits.rows["train"]
  stats = rows.pairs.stats
  notes = [f"{stats[k]:,} {k}" for k in ("truncated", "dropped") if stats[k]]
  if config.preference.shared_prefix:
    notes.append("prompts shared")
  eval_rows = splits.rows["eval"].rows_in_epoch(0) if "eval" in splits.rows else "no"
  description = (
      f"{config.data.train} ({', '.join([str(stats['kept']) + ' pairs'] + notes)}), "
      f"{config.packing.strategy} packing of whole pairs, seq_len {config.packing.seq_len}: "
      f"{rows.rows_in_epoch(0)} train rows/epoch, {eval_rows} eval rows")
  data = data_lib.Data(
      train=StreamBatches(rows, **layout),
      eval=StreamBatches(splits.rows["eval"], **layout) if "eval" in splits.rows else None,
      vocab_size=int(opened.vocab_size), train_rows_in_epoch0=rows.rows_in_epoch(0),
      description=description, segment_bound=max(
          d.segment_bound for d in splits.rows.values()),
      tokenizer_fingerprint=opened.tokenizer_fingerprint)
  return data, splits

"""Training and evaluation batches for the trainer: a dataset written by `segpack tokenize`
(`data.train`, plain or chat, with `data.eval` or a held-out share of its documents), the
built-in corpus, the built-in chat corpus (assistant-only loss) or synthetic documents (opened by
`train.data_sources`).

The training rows are one global stream (`pack_dataset` on one shard, infinite, reshuffled every
epoch; `segpack.data.stream`): global batch `k` is the next `batch_size` rows of the stream, and
process `p` of `Q` takes its contiguous block of `batch_size / Q` of them; the step function
assembles the global batch with `jax.make_array_from_process_local_data`. With
`packing.mode="minibatch"` (chat fine-tuning, docs/sft.md) every training batch is one minibatch
of `examples_per_batch` conversations, drawn as unpacked sampling draws it and packed into the
`batch_size` rows of a step (`pack_minibatches`), and process `p` takes its contiguous block of
those rows by the same rule (`segpack.data.processes`).

Either way the iterator's state is one position (`segpack.data.position`: `{"version": 1,
"unit": "rows" | "steps", "epoch", "index", "epoch_length"}`), the same on every process and
independent of the process count (and, in rows, of the batch size), so the checkpoint stores
one value and a run resumes on another number of processes (docs/training.md, "Resuming on
another process count or batch size"). Held-out rows are one finite pass of the row stream, cut
into global batches the same way (the last one filled up with padding rows).

With `mesh.context > 1` the training and held-out batches come out in context order with a
`"slot_index"` feature (`train.context_batches`): the order is applied to each batch after the
pipeline, so data positions and fingerprints are those of the batches in row order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

import grain
import numpy as np

from segpack.data import sources as sources_lib
from segpack.data import subset
from segpack.data.balance import BalanceOptions
from segpack.data.minibatch_dataset import MinibatchPackedDataset, pack_minibatches
from segpack.data.mixture import Mixture
from segpack.data.options import PipelineConfigError, SpecialTokens
from segpack.data.packed import pack_dataset
from segpack.data.stream import StreamBatches
from segpack.packing import LongDocs, PlanOptions
from segpack.packing.minibatch_planner import RowsPerBatchError
from train import context_batches
from train import data_sources
from train.data_sources import DataConfigError
_LOG = logging.getLogger(__name__)


def context_order(config: Any) -> context_batches.ContextOrder:
  """The batches' slot order: `mesh.context` devices per row, `packing.context_balance`
  (`ContextOrder.active` only with more than one)."""
  return context_batches.ContextOrder(size=config.mesh.context,
                                  balance=config.packing.context_balance)


def data_name(config: Any) -> str:
  """The training data, for the log: `data.train`, or the built-in source's name."""
  train = config.data.train
  return train if train is not None else f"{config.data.source} data"


@dataclasses.dataclass
class Data:
  """Per-process batches.

  Attributes:
    train: infinite `MapDataset` of this process's training batches (element `i` = the batch of
      step `i + 1` of a run from scratch): a `segpack.data.stream.StreamBatches` in global
      mode, a `MinibatchPackedDataset` in minibatch mode.
    eval: finite `StreamBatches` of held-out batches (one pass; this process's rows of each global
      batch, the last one filled up with padding rows).
    vocab_size: tokenizer vocabulary size.
    train_rows_in_epoch0: rows of the first training epoch over all processes (every epoch's
      unless a mixture, whose epochs each have their own: `train.rows_in_epoch(e)`).
    description: a one-line summary for the log.
    segment_bound: the most segments (documents or chunks) any train or eval row can hold,
      the same on every process: the plans' exact most in global mode; in minibatch mode with
      `examples_per_batch = k`, `min(k, seq_len)` for the training rows (a row's pieces belong to
      distinct examples). None when no bound below `seq_len` is known (minibatch mode with
      `tokens_per_batch`). The cuDNN attention backend's static bound comes from it.
    source_names: a mixture's source names (training rows then carry `segment_sources`, their
      indices); empty otherwise.
    eval_by_source: a mixture's held-out batches of each source, by name (empty otherwise).
    context: the slot order of the batches (`train.context_batches`); `eval` and `eval_by_source`
      come out in it, and so do the batches of `train_iterator` (not `train`'s own elements).
    tokenizer_fingerprint: the tokenizer of a `segpack tokenize` dataset (its manifest's
      `tokenizer_fingerprint`); None for the built-in and synthetic sources.
    source_weights: a mixture's weights (shares of trained tokens), in `source_names` order.
  """

  train: StreamBatches | MinibatchPackedDataset
  eval: grain.MapDataset | None  # None: no held-out data (data.eval_share=0, no data.eval)
  vocab_size: int
  train_rows_in_epoch0: int
  description: str
  segment_bound: int | None = None
  source_names: tuple[str, ...] = ()
  eval_by_source: dict[str, grain.MapDataset] = dataclasses.field(default_factory=dict)
  context: context_batches.ContextOrder = context_batches.ContextOrder()
  tokenizer_fingerprint: str | None = None
  source_weights: tuple[float, ...] = ()

  def __post_init__(self):
    if self.context.active and self.eval is not None:
      self.eval = context_batches.OrderedBatches(self.eval, order=self.context)
      self.eval_by_source = {name: context_batches.OrderedBatches(batches, order=self.context)
                             for name, batches in self.eval_by_source.items()}

  def train_iterator(self, *, read_options: grain.ReadOptions) -> grain.DatasetIterator:
    """An iterator over `train` whose `get_state()` does not depend on the process count.

    A `segpack.data.position.StreamIterator` in both modes: its state is the position of the next
    batch, in rows of the stream (global mode; also accepted from a run with another batch size)
    or in minibatch steps. With `context` active its batches come out in context order
    (`train.context_batches.OrderedIterator`).
    """
    iterator = self.train.iterator(read_options=read_options)
    if self.context.active:
      return context_batches.OrderedIterator(iterator, order=self.context)
    return iterator


def special_ids_error(config: Any, e: PipelineConfigError) -> DataConfigError | None:
  """The pipeline's refusal of a missing BOS/EOS id in the trainer's keys (None for another)."""
  for flag in ("add_bos", "add_eos"):
    if f"special_tokens.{flag}=True" in str(e):
      name = "BOS" if flag == "add_bos" else "EOS"
      return DataConfigError(
          f"{data_name(config)}: its tokenizer has no {name} token, and data.{flag}=True puts "
          f"one before (after) every document; pass --config.data.{flag}=False")
  return None


def make_data(config: Any, **kwargs: Any) -> Data:
  """`pack_data` (its arguments), a missing BOS/EOS id named by its config key."""
  try:
    return pack_data(config, **kwargs)
  except PipelineConfigError as e:
    raise special_ids_error(config, e) or e


def pack_data(config: Any, *, batch_size: int, process_index: int,
              process_count: int, num_ranks: int = 1) -> Data:
  """Packs the train and held-out splits and batches this process's rows.

  Args:
    config: the trainer config; its `data`, `packing` and `mesh.context` keys are read here.
    batch_size: rows per step over all processes (divisible by `process_count`).
    process_index: this process (`jax.process_index()`).
    process_count: number of processes (`jax.process_count()`).
    num_ranks: devices that split a global batch (the mesh's `data` x `fsdp`); with
      `packing.balance == "attention"` the rows of every global batch are dealt to them by
      attention cost (`segpack.data.balance`).
  """
  if batch_size % process_count:
    raise DataConfigError(
        f"train.batch_size={batch_size} is not divisible by the {process_count} processes")
  train_src, eval_src, vocab, ids, tokenizer = data_sources.sources(config)
  held_note = _held_out_note(config, train_src, eval_src)
  if sources_lib.template_writes_special_tokens(train_src, fn=f"data.train={config.data.train!r}"):
    _LOG.info("%s: its documents hold their chat template's BOS and end-of-turn tokens; packing "
              "adds no BOS/EOS (data.add_bos and data.add_eos do not apply)", data_name(config))
  plan = PlanOptions(seq_len=config.packing.seq_len, strategy=config.packing.strategy,
                     long_docs=LongDocs(mode=config.packing.long_docs),
                     max_segments_per_row=config.packing.max_segments_per_row)
  special = SpecialTokens(add_bos=config.data.add_bos, add_eos=config.data.add_eos, **ids)
  layout = dict(global_batch_size=batch_size, process_index=process_index,
                process_count=process_count)
  eval_rows = None if eval_src is None else pack_dataset(
      eval_src, plan=plan, special_tokens=special, shuffle=False, num_epochs=1)
  eval_batches = None if eval_rows is None else StreamBatches(eval_rows, **layout)
  if config.packing.mode == "minibatch":
    if isinstance(train_src, Mixture):
      raise DataConfigError(
          f"data.train={config.data.train!r} is a mixture, which packs globally; set "
          f"packing.mode='global'")
    data = _minibatch_data(config, train_src, eval_rows, eval_batches,
                           plan=dataclasses.replace(plan, max_segments_per_row=None),
                           special=special, process_index=process_index,
                           process_count=process_count, batch_size=batch_size, vocab=vocab)
    data.tokenizer_fingerprint = tokenizer
    data.description += held_note
    return data
  train_rows = pack_dataset(train_src, plan=plan, special_tokens=special, seed=config.data.seed,
                            shuffle=True, num_epochs=None, repack=config.packing.repack)
  train = StreamBatches(train_rows, balance=_balance(config, num_ranks=num_ranks), **layout)
  names = tuple(m.name for m in train_src.sources) if isinstance(train_src, Mixture) else ()
  by_source = {}
  if names and isinstance(eval_src, subset.DocumentSubset) and len(eval_src.parents) > 1:
    for name, part in zip(names, eval_src.by_parent()):
      rows = pack_dataset(part, plan=plan, special_tokens=special, shuffle=False, num_epochs=1)
      by_source[name] = StreamBatches(rows, **layout)
  return Data(
      train=train, eval=eval_batches, vocab_size=vocab,
      train_rows_in_epoch0=train_rows.rows_in_epoch(0),
      description=(f"{data_name(config)}{f' (mixture: {train_src.shares()})' if names else ''}, "
                   f"{config.packing.strategy} packing, seq_len {config.packing.seq_len}: "
                   f"{train_rows.rows_in_epoch(0)} train rows/epoch, {_eval_rows(eval_rows)}, "
                   f"vocab {vocab}{held_note}"),
      segment_bound=max(train_rows.segment_bound,
                        eval_rows.segment_bound if eval_rows else 0),
      source_names=names, eval_by_source=by_source, context=context_order(config),
      source_weights=tuple(float(m.weight) for m in train_src.sources) if names else (),
      tokenizer_fingerprint=tokenizer)


def _held_out_note(config: Any, train_src: Any, eval_src: Any) -> str:
  """With `data.eval_share`'s held-out split: `; held out: k of n documents, x% of the tokens`
  for the data line, and a warning when that share of the tokens is over 3x `data.eval_share`
  and 15 points above it (the share is drawn by document: a few long documents do that)."""
  if config.data.train is None or config.data.eval is not None or eval_src is None:
    return ""
  parts = [m.source for m in train_src.sources] if isinstance(train_src, Mixture) else [train_src]
  held = int(eval_src.lengths.sum())
  fraction = held / max(held + sum(int(p.lengths.sum()) for p in parts), 1)
  documents = len(eval_src), len(eval_src) + sum(len(p) for p in parts)
  share = config.data.eval_share
  if fraction > max(3 * share, share + 0.15):
    _LOG.warning("data.eval_share=%r held out %d of the %d documents of data.train, %.1f%% of "
                 "its tokens (the share is drawn by document); pass held-out data of its own "
                 "(data.eval=DIR) for a held-out split of another size", share, *documents,
                 100 * fraction)
  return f"; held out: {documents[0]} of {documents[1]} documents, {fraction:.1%} of the tokens"


def _eval_rows(eval_rows: Any) -> str:
  return ("no held-out data (data.eval_share=0): evaluation is off" if eval_rows is None
          else f"{eval_rows.rows_in_epoch(0)} eval rows")


def _balance(config: Any, *, num_ranks: int) -> BalanceOptions | None:
  """`packing.balance` as `StreamBatches(balance=...)` (None: the stream order)."""
  return None if config.packing.balance == "none" else BalanceOptions(num_ranks=num_ranks)


def _minibatch_data(config: Any, train_src: Any, eval_rows: Any, eval_batches: Any, *,
                    plan: PlanOptions, special: SpecialTokens, process_index: int,
                    process_count: int, batch_size: int, vocab: int) -> Data:
  """`packing.mode="minibatch"`: each step is one packed minibatch of `batch_size` rows."""
  try:  # the dataset plans epoch 0 as it is made
    train = pack_minibatches(
        train_src, plan=plan, special_tokens=special, process_index=process_index,
        process_count=process_count, seed=config.data.seed, shuffle=True, num_epochs=None,
        examples_per_batch=config.packing.examples_per_batch,
        tokens_per_batch=config.packing.tokens_per_batch, rows_per_batch=batch_size)
    steps = train.batches_in_epoch(0)
  except RowsPerBatchError as e:
    raise rows_per_batch_error(e) from e
  # Only a document's last chunk can be shorter than a row, so a row holding two or more pieces
  # holds pieces of distinct examples of one minibatch: at most examples_per_batch of them.
  bound = None
  if config.packing.examples_per_batch is not None:
    bound = max(min(int(config.packing.examples_per_batch), config.packing.seq_len),
                eval_rows.segment_bound if eval_rows else 0)
  return Data(
      train=train, eval=eval_batches, vocab_size=vocab, context=context_order(config),
      train_rows_in_epoch0=steps * batch_size, segment_bound=bound,
      description=(f"{data_name(config)}, minibatch {config.packing.strategy} packing of "
                   f"{config.packing.examples_per_batch or config.packing.tokens_per_batch} "
                   f"{'examples' if config.packing.examples_per_batch else 'tokens'} per step into "
                   f"{batch_size} rows, seq_len {config.packing.seq_len}: {steps} steps/epoch, "
                   f"{train.padded_slot_fraction(0):.1%} padded slots, "
                   f"{_eval_rows(eval_rows)}, vocab {vocab}"))


def rows_per_batch_error(e: RowsPerBatchError) -> DataConfigError:
  """The library's "raise rows_per_batch" in the trainer's keys (`train.batch_size` is it)."""
  return DataConfigError(
      f"packing.mode='minibatch': the minibatch of epoch {e.epoch}, step {e.batch + 1} of the "
      f"epoch, needs {e.needed} rows of packing.seq_len, but train.batch_size={e.rows_per_batch}"
      f" rows make a step; raise --config.train.batch_size to {e.needed} or more (divisible by "
      f"the devices), or lower packing.examples_per_batch / packing.tokens_per_batch")


def next_batch(iterator: Any) -> dict[str, np.ndarray]:
  """`next(iterator)` of `Data.train_iterator`, with a too-small step named by config keys."""
  try:
    return next(iterator)
  except RowsPerBatchError as e:
    raise rows_per_batch_error(e) from e


def fingerprint(batch: dict[str, np.ndarray]) -> tuple[str, list[str]]:
  """A hash of the whole batch and a short hash per row (to compare runs and processes); a batch
  in context order is hashed in row order, so the hashes do not depend on `mesh.context`."""
  batch = context_batches.row_order(batch)
  rows = []
  whole = hashlib.sha256()
  for r in range(len(batch["input_ids"])):
    h = hashlib.sha256()
    for key in ("input_ids", "labels", "segment_ids", "segment_positions"):
      h.update(np.ascontiguousarray(batch[key][r]).tobytes())
    rows.append(h.hexdigest()[:16])
    whole.update(h.digest())
  return whole.hexdigest()[:16], rows

"""`pack_minibatches`: packed minibatches, one element per optimizer step (a
`MinibatchPackedDataset`; the planner is `segpack.packing.minibatch_planner`).

Global packing (FFD over the whole epoch) needs the fewest rows, so with a fixed batch of rows an
epoch takes fewer optimizer steps than unpacked training with the same batch size. For
fine-tuning that changes the result. Minibatch packing draws the minibatches of examples exactly
as unpacked random sampling does and only packs within each, so an epoch takes the same number of
steps, each on the same examples, at a fraction of the padded compute.
"""

from __future__ import annotations

import builtins
import sys
import threading
from typing import Any

import grain
import numpy as np

from segpack.data import options
from segpack.data import rows as rows_lib
from segpack.data import sources
from segpack.data.options import LongDocs, PipelineConfigError, SpecialTokens
from segpack.packing.minibatch_planner import EpochPlan, MinibatchPlanner

__all__ = ["MinibatchPackedDataset", "pack_minibatches"]


class MinibatchPackedDataset(grain.MapDataset):
  """Packed minibatches as a random-access dataset: element `i` is optimizer step `i`'s batch.

  Algorithm for element `i` of process `shard_index` out of `shard_count`:
    1. Epoch `e` has `B_e` batches (`ceil(N / examples_per_batch)`, exactly the steps of
       unpacked training; with a token budget it depends on the epoch's order). `e` and the batch
       `b` follow from the cumulative batch counts (epochs are planned lazily, in order, and the
       last two kept).
    2. The batch's `rows_per_batch` rows (a multiple of `shard_count`) are rows `[b*R, (b+1)*R)`
       of the epoch plan; this process takes every `shard_count`-th of them from `shard_index`.
    3. `segpack.data.rows.RowBuilder` builds them: a dict of int32 `[R / shard_count, seq_len]`
       arrays `input_ids`, `labels`, `segment_ids`, `segment_positions` (empty rows: padding).

  Example: 10 examples, k = 4: 3 batches per epoch (4, 4, 2 examples), as unpacked training
  with batch size 4; element 4 is epoch 1's second batch.

  `rows_per_batch`: given, or (None) the most any batch of the `num_epochs` epochs needs
  (planned at construction), or for an infinite dataset a bound no batch can exceed (the chunk
  count of the `k` longest examples; loose for packing, exact for `strategy="pad"`).
  """

  def __init__(self, planner: MinibatchPlanner, builder: rows_lib.RowBuilder, *,
               num_epochs: int | None, rows_per_batch: int | None, shard_index: int,
               shard_count: int):
    super().__init__()
    self._planner = planner
    self._builder = builder
    self._num_epochs = num_epochs
    self._shard_index = shard_index
    self._shard_count = shard_count
    self._lock = threading.Lock()
    self._epochs: dict[int, EpochPlan] = {}
    self._cum = [0]  # batches before epoch e
    if rows_per_batch is None:
      if num_epochs is not None:
        rows_per_batch = max(int(planner.plan_epoch(e).rows_needed.max())
                             for e in range(num_epochs))
      elif planner.tokens_per_batch is not None:
        rows_per_batch = planner.budget_rows
      else:
        rows_per_batch = planner.row_bound()
    rows_per_batch = -(-int(rows_per_batch) // shard_count) * shard_count
    self.rows_per_batch = rows_per_batch
    if num_epochs is None:
      self._length = sys.maxsize
    else:
      for e in range(num_epochs):
        self._cum.append(self._cum[-1] + self._epoch(e).num_batches)
      self._length = self._cum[-1]

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    state["_epochs"] = {}
    del state["_lock"]
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return self._length

  def __str__(self) -> str:
    return (f"MinibatchPackedDataset(seq_len={self.seq_len}, rows_per_batch="
            f"{self.rows_per_batch}, num_epochs={self._num_epochs}, "
            f"shard={self._shard_index}/{self._shard_count})")

  @property
  def seq_len(self) -> int:
    return self._planner.seq_len

  @property
  def local_rows_per_batch(self) -> int:
    """Rows of each element on this process."""
    return self.rows_per_batch // self._shard_count

  def _epoch(self, epoch: int) -> EpochPlan:
    with self._lock:
      plan = self._epochs.get(epoch)
      if plan is None:
        plan = self._planner.plan_epoch(epoch, self.rows_per_batch)
        if len(self._epochs) >= 2:
          self._epochs.pop(next(iter(self._epochs)))
        self._epochs[epoch] = plan
      return plan

  def batches_in_epoch(self, epoch: int) -> int:
    """Optimizer steps of `epoch`."""
    return self._epoch(epoch).num_batches

  def epoch_plan(self, epoch: int) -> EpochPlan:
    """The plan of `epoch` (rows padded to `rows_per_batch` per batch)."""
    return self._epoch(epoch)

  def locate(self, index: int) -> tuple[int, int]:
    """(epoch, batch) of element `index`."""
    index = int(index)
    if self._num_epochs is not None:
      if not -self._length <= index < self._length:
        raise IndexError(f"MinibatchPackedDataset: index {index} out of range for "
                         f"{self._length} batches")
      index %= self._length
    elif index < 0:
      raise IndexError(f"negative index into an infinite MinibatchPackedDataset: {index}")
    with self._lock:
      cum = self._cum
    while cum[-1] <= index:
      e = len(cum) - 1
      n = self._epoch(e).num_batches
      with self._lock:
        if len(self._cum) == e + 1:
          self._cum.append(self._cum[-1] + n)
        cum = self._cum
    e = int(np.searchsorted(cum, index, side="right")) - 1
    return e, index - cum[e]

  def batch_examples(self, index: int) -> np.ndarray:
    """The example (document) ids of element `index`, in sampling order."""
    e, b = self.locate(index)
    plan = self._epoch(e)
    return plan.examples[plan.batch_examples[b]:plan.batch_examples[b + 1]]

  def __getitem__(self, index):
    if isinstance(index, builtins.slice):
      return self.slice(index)
    e, b = self.locate(index)
    plan = self._epoch(e)
    rows = np.arange(b * self.rows_per_batch + self._shard_index,
                     (b + 1) * self.rows_per_batch, self._shard_count)
    builder = self._builder.with_plan(plan.plan)
    with self._stats.record_self_time():
      return self._stats.record_output_spec(builder.build(rows))

  def padded_slot_fraction(self, epoch: int = 0) -> float:
    """Share of the epoch's slots (`batches * rows_per_batch * seq_len`) that are padding."""
    plan = self._epoch(epoch)
    slots = plan.num_batches * self.rows_per_batch * self.seq_len
    return 1.0 - float(np.asarray(plan.plan.length, dtype=np.int64).sum()) / slots


def pack_minibatches(
    source: Any,
    *,
    seq_len: int,
    examples_per_batch: int | None = None,
    tokens_per_batch: int | None = None,
    rows_per_batch: int | None = None,
    drop_remainder: bool = False,
    strategy: str = "ffd",
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    special_tokens: SpecialTokens = options.DEFAULT_SPECIAL_TOKENS,
    long_docs: LongDocs = options.DEFAULT_LONG_DOCS,
    shard_options: grain.sharding.ShardOptions | None = None,
    loss_mask: bool | None = None,
) -> MinibatchPackedDataset:
  """Packs the minibatches that unpacked random sampling draws, each on its own.

  Element `i` is optimizer step `i`'s batch: a dict of int32 `[rows_per_batch / shard_count,
  seq_len]` arrays `input_ids`, `labels`, `segment_ids`, `segment_positions` (docs/packing.md,
  "Minibatch packing"). The algorithm:

  1. Each epoch's example order is a permutation seeded by `(seed, epoch)` (the order unpacked
     sampling uses; plan order without `shuffle`); documents with fewer than
     `long_docs.min_len` tokens are left out.
  2. The order is cut into minibatches: `examples_per_batch` examples each (the last one short,
     or dropped with `drop_remainder`), or, with `tokens_per_batch`, consecutive examples while
     their chunks fit `tokens_per_batch // seq_len` rows.
  3. `strategy` packs each minibatch's pieces (documents as `[BOS] + tokens + [EOS]`, split or
     truncated as `long_docs` says) into rows, padded with empty rows to `rows_per_batch`.
  4. Each process takes every `shard_count`-th row of the batch from its `shard_index`;
     `rows_per_batch` is rounded up to a multiple of `shard_count`.

  Tiny example: 10 examples, `examples_per_batch=4`: every epoch has 3 steps (4, 4 and 2
  examples), as unpacked training with batch size 4 does; element 4 is epoch 1's second batch,
  and its rows hold exactly the examples at positions 4..7 of epoch 1's permutation.

  Args:
    source: a dataset directory, a `segpack.ShardSource`, or any random-access sequence of 1-D
      integer arrays (a `grain.MapDataset` included).
    seq_len: slots per row.
    examples_per_batch: examples per minibatch (as unpacked training's batch size); exactly one
      of it and `tokens_per_batch`.
    tokens_per_batch: a token budget instead: each batch has `tokens_per_batch // seq_len` rows
      and takes examples while they fit.
    rows_per_batch: static rows per batch (over all processes); None: the most any batch needs
      over `num_epochs` epochs (for an infinite dataset a bound no batch can exceed).
    drop_remainder: drop each epoch's last, short minibatch.
    strategy: planner for each minibatch, one of `segpack.packing.STRATEGIES`.
    seed: sampling seed; epoch `e` uses a generator seeded by `(seed, e)`.
    shuffle: shuffle the examples of every epoch (else source order).
    num_epochs: None for an infinite dataset, else the number of epochs.
    special_tokens: BOS/EOS insertion and the BOS/EOS/padding ids; None ids come from the
      source's tokenizer.
    long_docs: splitting or truncating long documents, chunk overlap, the minimum length.
    shard_options: this process's share of every batch's rows, a `grain.sharding.ShardOptions`
      (or any object with `shard_index`, `shard_count`, `drop_remainder`); None:
      `jax.process_index()` of `jax.process_count()`. Its `drop_remainder` has no effect here
      (every batch's rows are a multiple of `shard_count`).
    loss_mask: apply the source's per-token loss mask; None: when the source has one.

  Returns:
    A `MinibatchPackedDataset`.

  Raises:
    PipelineConfigError: an argument is invalid, the source is empty, no document survives, or
      a batch needs more than `rows_per_batch` rows.
  """
  fn = "pack_minibatches"
  options.check_args(fn, seq_len=seq_len, strategy=strategy, seed=seed, num_epochs=num_epochs,
                     special_tokens=special_tokens, long_docs=long_docs)
  if (examples_per_batch is None) == (tokens_per_batch is None):
    raise PipelineConfigError(
        f"{fn}: needs exactly one of examples_per_batch and tokens_per_batch, got "
        f"examples_per_batch={examples_per_batch!r}, tokens_per_batch={tokens_per_batch!r}")
  for name, value in (("examples_per_batch", examples_per_batch),
                      ("tokens_per_batch", tokens_per_batch), ("rows_per_batch", rows_per_batch)):
    options.positive_or_none(fn, name, value)
  if not isinstance(drop_remainder, (bool, np.bool_)):
    raise PipelineConfigError(f"{fn}: drop_remainder must be a bool, got {drop_remainder!r}")
  index, count = options.resolve_shard(fn, shard_options)
  prepared = sources.prepare(source, fn=fn, special_tokens=special_tokens, loss_mask=loss_mask)
  planner = MinibatchPlanner(
      prepared.lengths, seq_len=int(seq_len), strategy=strategy, long_docs=long_docs.mode,
      min_len=int(long_docs.min_len), overlap=int(long_docs.overlap),
      extra_tokens=prepared.special.extra_tokens, seed=int(seed), shuffle=bool(shuffle),
      examples_per_batch=examples_per_batch, tokens_per_batch=tokens_per_batch,
      drop_remainder=bool(drop_remainder))
  builder = rows_lib.RowBuilder(prepared.source, planner.empty_plan(), special=prepared.special,
                                doc_lengths=prepared.lengths, loss_mask=prepared.loss_mask)
  return MinibatchPackedDataset(
      planner, builder, num_epochs=num_epochs, rows_per_batch=rows_per_batch,
      shard_index=index, shard_count=count)

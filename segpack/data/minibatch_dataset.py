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
from segpack.data import processes
from segpack.data import rows as rows_lib
from segpack.data import sources
from segpack.data.options import PipelineConfigError, SpecialTokens
from segpack.data.position import StreamIterator, StreamPosition
from segpack.packing.chunking import LongDocs
from segpack.packing.minibatch_planner import MinibatchPlan, MinibatchPlanner
from segpack.packing.options import PlanOptions

__all__ = ["MinibatchPackedDataset", "pack_minibatches"]


class MinibatchPackedDataset(grain.MapDataset):
  """This process's block of every packed minibatch: element `i` is optimizer step `i`'s batch.

  Algorithm for element `i` of process `p` of `Q` (`R = rows_per_batch`, a multiple of `Q`),
  from the start position (epoch `e0`, step `b0`):
    1. Element `i` is global step `s + i`, where `s` is the steps of the epochs before `e0`
       plus `b0`. Epoch `e` has `B_e` steps (`ceil(N / examples_per_batch)`, exactly the steps
       of unpacked training; with a token budget it depends on the epoch's order); the epoch
       `e` and its step `b` follow from the cumulative step counts (epochs are planned lazily,
       in order, and the last two kept).
    2. The step's `R` rows are rows `[b*R, (b+1)*R)` of the epoch plan; process `p` takes the
       contiguous block `[p*R/Q, (p+1)*R/Q)` of them (`segpack.data.processes.process_block`,
       the rule of `StreamBatches` too).
    3. `segpack.data.rows.RowBuilder` builds them: a dict of int32 `[R / Q, seq_len]` arrays
       `input_ids`, `labels`, `segment_ids`, `segment_positions` (empty rows: padding).

  Example: 10 examples, k = 4: 3 steps per epoch (4, 4, 2 examples), as unpacked training
  with batch size 4; element 4 is epoch 1's second step. With `R = 4` and `Q = 2`, process 1
  gets rows 2 and 3 of that step. `iterator()`'s state after 4 steps is `{"version": 1,
  "unit": "steps", "epoch": 1, "index": 1, "epoch_length": 3}` on any process count
  (`segpack.data.position`).

  `rows_per_batch`: given, or (None) the most any batch of the `num_epochs` epochs needs
  (planned at construction), or for an infinite dataset a bound no batch can exceed (the chunk
  count of the `k` longest examples; loose for packing, exact for `strategy="pad"`); then
  rounded up to a multiple of `Q`.
  """

  def __init__(self, planner: MinibatchPlanner, builder: rows_lib.RowBuilder, *,
               num_epochs: int | None, rows_per_batch: int | None, process_index: int,
               process_count: int, start: StreamPosition = StreamPosition(epoch=0, index=0)):
    super().__init__()
    self._planner = planner
    self._builder = builder
    self._num_epochs = num_epochs
    self._process_index = process_index
    self._process_count = process_count
    self._lock = threading.Lock()
    self._epochs: dict[int, MinibatchPlan] = {}
    self._cum = [0]  # steps before epoch e
    if rows_per_batch is None:
      if num_epochs is not None:
        rows_per_batch = max(int(planner.plan(e).rows_needed.max())
                             for e in range(num_epochs))
      elif planner.tokens_per_batch is not None:
        rows_per_batch = planner.budget_rows
      else:
        rows_per_batch = planner.row_bound()
    rows_per_batch = -(-int(rows_per_batch) // process_count) * process_count
    self.rows_per_batch = rows_per_batch
    total = sys.maxsize
    if num_epochs is not None:
      for e in range(num_epochs):
        self._cum.append(self._cum[-1] + self._epoch(e).num_batches)
      total = self._cum[-1]
    self._start = self._start_step(start, total)
    self._length = sys.maxsize if num_epochs is None else total - self._start

  def _start_step(self, start: StreamPosition, total: int) -> int:
    """The global step of `start` (at most `total`, the end of a finite dataset)."""
    if (not isinstance(start, StreamPosition) or start.epoch < 0
        or not 0 <= start.index < self.batches_in_epoch(start.epoch)):
      raise PipelineConfigError(
          f"pack_minibatches: start must be a StreamPosition with 0 <= index < the steps of its "
          f"epoch, got {start!r}")
    step = self._cumulative(epoch=start.epoch)[start.epoch] + start.index
    if step > total:
      raise PipelineConfigError(
          f"pack_minibatches: start={start!r} lies past the {total} steps of the "
          f"{self._num_epochs} epochs")
    return step

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
            f"process={self._process_index}/{self._process_count}, start={self.start})")

  @property
  def seq_len(self) -> int:
    return self._planner.seq_len

  def _epoch(self, epoch: int) -> MinibatchPlan:
    with self._lock:
      plan = self._epochs.get(epoch)
      if plan is None:
        plan = self._planner.plan(epoch, self.rows_per_batch)
        if len(self._epochs) >= 2:
          self._epochs.pop(next(iter(self._epochs)))
        self._epochs[epoch] = plan
      return plan

  def _cumulative(self, *, epoch: int = 0, step: int = -1) -> list[int]:
    """The steps before each epoch, planned far enough to hold `epoch`'s start and `step`."""
    with self._lock:
      cum = self._cum
    while len(cum) <= epoch or cum[-1] <= step:
      e = len(cum) - 1
      n = self._epoch(e).num_batches
      with self._lock:
        if len(self._cum) == e + 1:
          self._cum.append(self._cum[-1] + n)
        cum = self._cum
    return cum

  def batches_in_epoch(self, epoch: int) -> int:
    """Optimizer steps of `epoch`."""
    return self._epoch(epoch).num_batches

  def plan(self, epoch: int) -> MinibatchPlan:
    """The plan of `epoch` (rows padded to `rows_per_batch` per batch)."""
    return self._epoch(epoch)

  @property
  def unit(self) -> str:
    """What a position's index counts here: "steps" (of the epoch)."""
    return "steps"

  def epoch_length(self, epoch: int) -> int:
    """Steps of epoch `epoch` (the iterator state's `epoch_length`)."""
    return self.batches_in_epoch(epoch)

  def _split(self, step: int) -> tuple[int, int]:
    """(epoch, step in the epoch) of global step `step`."""
    cum = self._cumulative(step=step)
    e = int(np.searchsorted(cum, step, side="right")) - 1
    return e, step - cum[e]

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
    return self._split(self._start + index)

  def position(self, k: int) -> StreamPosition:
    """Where element `k` starts: its epoch and step (`k = len(self)`: the end)."""
    epoch, step = self._split(self._start + int(k))
    return StreamPosition(epoch=epoch, index=step)

  @property
  def start(self) -> StreamPosition:
    return self.position(0)

  def starting_at(self, start: StreamPosition) -> "MinibatchPackedDataset":
    """The same steps and layout, element 0 being the step at `start`."""
    return MinibatchPackedDataset(
        self._planner, self._builder, num_epochs=self._num_epochs,
        rows_per_batch=self.rows_per_batch, process_index=self._process_index,
        process_count=self._process_count, start=start)

  def iterator(self, *, read_options: grain.ReadOptions | None = None) -> StreamIterator:
    """A `StreamIterator` over these steps; its state is the position in steps
    (`segpack.data.position`), the same on every process count."""
    return StreamIterator(self, read_options=read_options)

  def _local_rows(self, batch: int) -> np.ndarray:
    """int64 `[R / Q]`: this process's rows of step `batch` of its epoch's plan."""
    rows = np.arange(batch * self.rows_per_batch, (batch + 1) * self.rows_per_batch)
    return rows[processes.process_block(self.rows_per_batch, process_index=self._process_index,
                                        process_count=self._process_count)]

  def plan_rows(self, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`(epoch, plan row)` of each of this process's rows of element `k` (int64 `[R / Q]`
    each); the plan row indexes `plan(epoch).plan` (empty rows are padding)."""
    e, b = self.locate(k)
    rows = self._local_rows(b)
    return np.full(rows.shape, e, dtype=np.int64), rows

  def batch_examples(self, index: int) -> np.ndarray:
    """The example (document) ids of element `index`, in sampling order."""
    e, b = self.locate(index)
    plan = self._epoch(e)
    return plan.examples[plan.batch_examples[b]:plan.batch_examples[b + 1]]

  def __getitem__(self, index):
    if isinstance(index, builtins.slice):
      return self.slice(index)
    e, b = self.locate(index)
    builder = self._builder.with_plan(self._epoch(e).plan)
    with self._stats.record_self_time():
      return self._stats.record_output_spec(builder.build(self._local_rows(b)))

  def padded_slot_fraction(self, epoch: int = 0) -> float:
    """Share of the epoch's slots (`batches * rows_per_batch * seq_len`) that are padding."""
    plan = self._epoch(epoch)
    slots = plan.num_batches * self.rows_per_batch * self.seq_len
    return 1.0 - float(np.asarray(plan.plan.length, dtype=np.int64).sum()) / slots


def pack_minibatches(
    source: Any,
    *,
    plan: PlanOptions | None = None,
    seq_len: int | None = None,
    process_index: int,
    process_count: int,
    examples_per_batch: int | None = None,
    tokens_per_batch: int | None = None,
    rows_per_batch: int | None = None,
    drop_remainder: bool = False,
    strategy: str | None = None,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    special_tokens: SpecialTokens = options.DEFAULT_SPECIAL_TOKENS,
    long_docs: LongDocs | None = None,
    loss_mask: bool | None = None,
) -> MinibatchPackedDataset:
  """Packs the minibatches that unpacked random sampling draws, each on its own.

  Element `i` is optimizer step `i`'s batch: this process's dict of int32 `[rows_per_batch /
  process_count, seq_len]` arrays `input_ids`, `labels`, `segment_ids`, `segment_positions`
  (docs/packing.md, "Minibatch packing"). The packing settings are one `segpack.PlanOptions`
  (`plan=`), or the keywords `seq_len`, `strategy` and `long_docs` that spell it. The
  algorithm:

  1. Each epoch's example order is a permutation seeded by `(seed, epoch)` (the order unpacked
     sampling uses; plan order without `shuffle`); documents with fewer than
     `long_docs.min_len` tokens are left out.
  2. The order is cut into minibatches: `examples_per_batch` examples each (the last one short,
     or dropped with `drop_remainder`), or, with `tokens_per_batch`, consecutive examples while
     their chunks fit `tokens_per_batch // seq_len` rows.
  3. `strategy` packs each minibatch's pieces (documents as `[BOS] + tokens + [EOS]`, split or
     truncated as `long_docs` says) into rows, padded with empty rows to `rows_per_batch`.
  4. Process `process_index` of `process_count` takes its contiguous block of every batch's
     rows (`segpack.data.processes.process_block`, as `StreamBatches` does); `rows_per_batch`
     is rounded up to a multiple of `process_count`.

  Tiny example: 10 examples, `examples_per_batch=4`: every epoch has 3 steps (4, 4 and 2
  examples), as unpacked training with batch size 4 does; element 4 is epoch 1's second batch,
  and its rows hold exactly the examples at positions 4..7 of epoch 1's permutation. Its
  `iterator()` saves the position in steps (`segpack.data.position`), which resumes on any
  process count.

  Args:
    source: a dataset directory, a `segpack.ShardSource`, or any random-access sequence of 1-D
      integer arrays (a `grain.MapDataset` included).
    plan: the packing settings, a `segpack.PlanOptions` (`seq_len`, `strategy`: the packer of
      each minibatch, `long_docs`); its `max_segments_per_row`, `batch_size` and
      `pad_multiple` do not apply here and must stay at their defaults. None: the keywords
      `seq_len`, `strategy`, `long_docs` spell it.
    seq_len: `PlanOptions.seq_len`, without `plan`.
    process_index: this process, `0 <= process_index < process_count`
      (`jax.process_index()` in a JAX program).
    process_count: processes that split every batch's rows (`jax.process_count()`).
    examples_per_batch: examples per minibatch (as unpacked training's batch size); exactly one
      of it and `tokens_per_batch`.
    tokens_per_batch: a token budget instead: each batch has `tokens_per_batch // seq_len` rows
      and takes examples while they fit.
    rows_per_batch: static rows per batch (over all processes); None: the most any batch needs
      over `num_epochs` epochs (for an infinite dataset a bound no batch can exceed).
    drop_remainder: drop each epoch's last, short minibatch.
    strategy: `PlanOptions.strategy`, without `plan` (None: "ffd").
    seed: sampling seed; epoch `e` uses a generator seeded by `(seed, e)`.
    shuffle: shuffle the examples of every epoch (else source order).
    num_epochs: None for an infinite dataset, else the number of epochs.
    special_tokens: BOS/EOS insertion and the BOS/EOS/padding ids; None ids come from the
      source's tokenizer.
    long_docs: `PlanOptions.long_docs`, without `plan` (None: `LongDocs()`).
    loss_mask: apply the source's per-token loss mask; None: when the source has one.

  Returns:
    A `MinibatchPackedDataset`.

  Raises:
    PipelineConfigError: an argument is invalid, the source is empty, no document survives, or
      a batch needs more than `rows_per_batch` rows.
  """
  fn = "pack_minibatches"
  index, count = processes.check_processes(fn, process_index=process_index,
                                           process_count=process_count)
  plan = options.plan_options(fn, plan, seq_len=seq_len, strategy=strategy, long_docs=long_docs)
  options.check_args(fn, plan=plan, seed=seed, num_epochs=num_epochs,
                     special_tokens=special_tokens)
  options.refuse_fields(fn, plan, ("max_segments_per_row", "batch_size", "pad_multiple"),
                        why="minibatch packing caps no row and keeps no plan statistics")
  if (examples_per_batch is None) == (tokens_per_batch is None):
    raise PipelineConfigError(
        f"{fn}: needs exactly one of examples_per_batch and tokens_per_batch, got "
        f"examples_per_batch={examples_per_batch!r}, tokens_per_batch={tokens_per_batch!r}")
  for name, value in (("examples_per_batch", examples_per_batch),
                      ("tokens_per_batch", tokens_per_batch), ("rows_per_batch", rows_per_batch)):
    options.positive_or_none(fn, name, value)
  if not isinstance(drop_remainder, (bool, np.bool_)):
    raise PipelineConfigError(f"{fn}: drop_remainder must be a bool, got {drop_remainder!r}")
  prepared = sources.prepare(source, fn=fn, special_tokens=special_tokens, loss_mask=loss_mask)
  planner = MinibatchPlanner(
      prepared.lengths, seq_len=int(plan.seq_len), strategy=plan.strategy,
      long_docs=plan.long_docs, extra_tokens=prepared.special.extra_tokens, seed=int(seed),
      shuffle=bool(shuffle), examples_per_batch=examples_per_batch,
      tokens_per_batch=tokens_per_batch, drop_remainder=bool(drop_remainder))
  builder = rows_lib.RowBuilder(prepared.source, planner.empty_plan(), special=prepared.special,
                                doc_lengths=prepared.lengths, loss_mask=prepared.loss_mask)
  return MinibatchPackedDataset(
      planner, builder, num_epochs=num_epochs, rows_per_batch=rows_per_batch,
      process_index=index, process_count=count)

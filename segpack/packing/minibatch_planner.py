"""The minibatch planner: cut an epoch's example order into minibatches and pack each one.

`MinibatchPlanner.plan(epoch)` is the epoch's `MinibatchPlan`;
`segpack.data.minibatch_dataset.MinibatchPackedDataset` serves it as one element per optimizer
step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from segpack.errors import PipelineConfigError
from segpack.packing.chunking import LongDocs, chunk_counts, chunk_spans
from segpack.packing.ffd import first_fit_decreasing
from segpack.packing.first_fit import FirstFitTree
from segpack.packing.permutation import epoch_permutation
from segpack.packing.plan_format import Plan
from segpack.packing.planner import plan as plan_rows

__all__ = ["MinibatchConfigError", "MinibatchPlan", "MinibatchPlanner", "RowsPerBatchError"]


class MinibatchConfigError(PipelineConfigError):
  """An argument of minibatch packing is invalid (the message names it and echoes the value)."""


class RowsPerBatchError(MinibatchConfigError):
  """A minibatch needs more rows than `rows_per_batch`; `epoch`, `batch`, `needed` and
  `rows_per_batch` say which and by how much (a trainer names its own config keys with them)."""

  def __init__(self, message: str, *, epoch: int, batch: int, needed: int, rows_per_batch: int):
    super().__init__(message)
    self.epoch, self.batch, self.needed, self.rows_per_batch = epoch, batch, needed, rows_per_batch


@dataclasses.dataclass(frozen=True)
class MinibatchPlan:
  """The rows of one epoch's minibatches, batch-major: batch `b` is rows `[b*R, (b+1)*R)`, `R = rows_per_batch`.

  Attributes:
    plan: the rows (empty rows are padding rows), document ids global.
    batch_examples: int64 `[num_batches + 1]` splits into `examples` per batch.
    examples: int64 the examples of the epoch in sampling order.
    rows_needed: int64 `[num_batches]` non-empty rows of each batch.
  """

  plan: Plan
  batch_examples: np.ndarray
  examples: np.ndarray
  rows_needed: np.ndarray

  @property
  def num_batches(self) -> int:
    return int(self.rows_needed.shape[0])


class MinibatchPlanner:
  """Cuts an epoch's example order into minibatches and packs each one.

  Algorithm for epoch `e`:
    1. `order = examples[epoch_permutation(N, seed=seed, epoch=e)]` (`examples` itself without
       shuffle), where `examples` are the documents with at least `long_docs.min_len` tokens.
    2. Minibatches: with `examples_per_batch = k`, batch `b` is `order[b*k:(b+1)*k]` (the last one
       shorter, or dropped with `drop_remainder`); with `tokens_per_batch`, `R = tokens_per_batch
       // seq_len` and a batch takes the next examples in order while all their chunks fit
       first-fit (`segpack.packing.first_fit`) into `R` rows (a batch is a contiguous run of
       `order`).
    3. Packing: `examples_per_batch` batches are packed on their examples alone: `"ffd"` (the
       default: as few rows as fit) with `segpack.packing.ffd.first_fit_decreasing`, `"pad"` one
       chunk per row (unpacked training), the other strategies with `segpack.packing.plan`;
       token-budget batches keep their first-fit rows. Chunks are cut by
       `segpack.packing.chunking.chunk_spans`: a document is split across rows only when its
       virtual length exceeds `seq_len`.
    4. Every batch is padded with empty rows to `rows_per_batch` rows, a static shape for jit.

  Example: lengths [5, 3, 2, 6], seq_len 8, no BOS/EOS, k = 2, permutation [3, 1, 0, 2]: batch 0
  = examples {3, 1} (6 + 3 > 8: two rows), batch 1 = {0, 2} (one row [5, 2]); rows_per_batch 2,
  so batch 1 gets one padding row.
  """

  def __init__(self, lengths: np.ndarray, *, seq_len: int, strategy: str, long_docs: LongDocs,
               extra_tokens: int, seed: int, shuffle: bool,
               examples_per_batch: int | None, tokens_per_batch: int | None,
               drop_remainder: bool):
    self.lengths = np.asarray(lengths, dtype=np.int64)
    self.seq_len = int(seq_len)
    self.strategy = strategy
    self.long_docs = long_docs
    self.overlap = int(long_docs.overlap)
    self.extra = int(extra_tokens)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.examples_per_batch = examples_per_batch
    self.tokens_per_batch = tokens_per_batch
    self.drop_remainder = bool(drop_remainder)
    min_len = long_docs.min_len
    self.examples = np.flatnonzero((self.lengths >= min_len) & (self.lengths > 0))
    if self.examples.size == 0:
      raise MinibatchConfigError(
          f"minibatch packing: no document of the {self.lengths.size} has >= "
          f"long_docs.min_len={min_len} tokens")
    if tokens_per_batch is not None:
      self.budget_rows = int(tokens_per_batch) // self.seq_len
      if self.budget_rows < 1:
        raise MinibatchConfigError(
            f"minibatch packing: tokens_per_batch={tokens_per_batch} is less than seq_len="
            f"{self.seq_len}: not one row fits")

  def order(self, epoch: int) -> np.ndarray:
    """The examples of `epoch` in sampling order."""
    if not self.shuffle:
      return self.examples
    return self.examples[epoch_permutation(self.examples.size, seed=self.seed, epoch=epoch)]

  def _chunks(self, length: int) -> list[tuple[int, int]]:
    """(start, slots) of the chunks of a document of `length` tokens."""
    return chunk_spans(length, self.seq_len, long_docs=self.long_docs, extra_tokens=self.extra)

  def empty_plan(self) -> Plan:
    """A plan of no rows with this planner's `seq_len`, `overlap` and `extra_tokens`."""
    return Plan(seq_len=self.seq_len, overlap=self.overlap, extra_tokens=self.extra,
                strategy=self.strategy, row_splits=np.zeros(1, np.int64),
                doc=np.zeros(0, np.int64), start=np.zeros(0, np.int32),
                length=np.zeros(0, np.int32))

  def row_bound(self) -> int:
    """Rows no `examples_per_batch` batch can exceed: the chunks of the `k` examples with the
    most chunks (loose for packing, exact for `strategy="pad"`)."""
    chunks = chunk_counts(self.lengths[self.examples], self.seq_len, long_docs=self.long_docs,
                          extra_tokens=self.extra)
    return int(np.sort(chunks)[::-1][:int(self.examples_per_batch)].sum())

  def plan(self, epoch: int, rows_per_batch: int | None = None) -> MinibatchPlan:
    """The plan of `epoch`; `rows_per_batch` None leaves batches at their own row counts (no
    padding rows), which `rows_per_batch` then pads to."""
    order = self.order(epoch)
    if self.tokens_per_batch is not None:
      batches = self._budget_batches(order)
    else:
      k = int(self.examples_per_batch)
      stop = order.size - order.size % k if self.drop_remainder else order.size
      batches = [self._pack(order[a:min(a + k, stop)]) for a in range(0, stop, k)]
    return _assemble(batches, epoch, rows_per_batch, seq_len=self.seq_len, overlap=self.overlap,
                     extra_tokens=self.extra, strategy=self.strategy)

  def _pack(self, docs: np.ndarray) -> tuple[np.ndarray, list[list[tuple[int, int, int]]]]:
    if self.strategy in ("ffd", "pad"):  # small batches: no chunking pass or plan statistics
      pieces = [(d, start, n) for d, length in zip(docs.tolist(), self.lengths[docs].tolist())
                for start, n in self._chunks(length)]
      if self.strategy == "pad":
        return docs, [[piece] for piece in pieces]
      placement = first_fit_decreasing(np.asarray([n for _, _, n in pieces], np.int64),
                                       self.seq_len)
      rows: list[list[tuple[int, int, int]]] = [[] for _ in range(int(placement.bins.max()) + 1)]
      for i, r in zip(placement.order.tolist(), placement.bins.tolist()):
        rows[r].append(pieces[i])  # in placement order, the order of the pieces in a row
      return docs, rows
    # Every example has at least `min_len` tokens, so the plan drops none of `docs`.
    plan = plan_rows(self.lengths[docs], self.seq_len, strategy=self.strategy,
                     long_docs=self.long_docs, extra_tokens=self.extra)
    rows = []
    doc = docs[np.asarray(plan.doc)].tolist()
    start, length = np.asarray(plan.start).tolist(), np.asarray(plan.length).tolist()
    splits = np.asarray(plan.row_splits).tolist()
    for r in range(plan.num_rows):
      rows.append([(doc[p], start[p], length[p]) for p in range(splits[r], splits[r + 1])])
    return docs, rows

  def _budget_batches(self, order: np.ndarray):
    """Token-budget batches: consecutive examples while their chunks fit first-fit in R rows."""
    rows_cap, seq_len = self.budget_rows, self.seq_len
    batches, current = [], []
    free, rows = FirstFitTree([seq_len] * rows_cap), [[] for _ in range(rows_cap)]
    for d, length in zip(order.tolist(), self.lengths[order].tolist()):
      chunks = self._chunks(length)
      placed = free.place([n for _, n in chunks])
      if placed is None and current:
        batches.append((np.asarray(current, np.int64), [x for x in rows if x]))
        current = []
        free, rows = FirstFitTree([seq_len] * rows_cap), [[] for _ in range(rows_cap)]
        placed = free.place([n for _, n in chunks])
      if placed is None:
        raise MinibatchConfigError(
            f"minibatch packing: document {d} needs {len(chunks)} rows of seq_len={seq_len} "
            f"but tokens_per_batch={self.tokens_per_batch} gives only {rows_cap}; raise "
            f"tokens_per_batch or use LongDocs(mode='truncate')")
      for r, (start, n) in zip(placed, chunks):
        rows[r].append((d, start, n))
      current.append(d)
    if current and not (self.drop_remainder and batches):
      batches.append((np.asarray(current, np.int64), [x for x in rows if x]))
    return batches


def _assemble(batches, epoch, rows_per_batch, *, seq_len: int, overlap: int, extra_tokens: int,
              strategy: str) -> MinibatchPlan:
  """Lays the batches' rows out batch-major, padding each batch with empty rows."""
  needed = np.asarray([len(rows) for _, rows in batches], dtype=np.int64)
  width = int(needed.max()) if rows_per_batch is None else int(rows_per_batch)
  if needed.size and int(needed.max()) > width:
    b = int(np.argmax(needed))
    raise RowsPerBatchError(
        f"minibatch packing: epoch {epoch} batch {b} needs {int(needed[b])} rows but "
        f"rows_per_batch={width}; "
        f"raise rows_per_batch (or leave it None with a finite num_epochs to size it exactly)",
        epoch=int(epoch), batch=b, needed=int(needed[b]), rows_per_batch=width)
  counts, doc, start, length = [], [], [], []
  for _, rows in batches:
    for row in rows:
      counts.append(len(row))
      for d, s, n in row:
        doc.append(d)
        start.append(s)
        length.append(n)
    counts += [0] * (width - len(rows))
  row_splits = np.zeros(len(counts) + 1, dtype=np.int64)
  np.cumsum(counts, out=row_splits[1:])
  plan = Plan(
      seq_len=seq_len, overlap=overlap, extra_tokens=extra_tokens, strategy=strategy,
      row_splits=row_splits, doc=np.asarray(doc, dtype=np.int64),
      start=np.asarray(start, dtype=np.int32), length=np.asarray(length, dtype=np.int32))
  splits = np.zeros(len(batches) + 1, dtype=np.int64)
  np.cumsum([len(ex) for ex, _ in batches], out=splits[1:])
  examples = (np.concatenate([ex for ex, _ in batches]) if batches
              else np.zeros(0, dtype=np.int64))
  return MinibatchPlan(plan=plan, batch_examples=splits, examples=examples, rows_needed=needed)

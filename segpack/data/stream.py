"""The global row stream: batches whose position does not depend on the process count.

A `pack_dataset` is the *stream*: element `t` is the row at position `t`, epoch `t // R` and
index `t % R` of that epoch's permutation of the `R` plan rows, the same on every process.
`StreamBatches` cuts the stream into global batches and hands each process its block of each
(`segpack.data.processes.process_block`, the rule `pack_minibatches` follows too);
`StreamIterator` walks them and checkpoints the position in rows
(`segpack.data.position`: `{"version": 1, "unit": "rows", "epoch", "index", "epoch_length"}`),
so a run saved on `P` processes resumes on `Q` (and with another global batch size) at the same
row: every row of every epoch is consumed exactly once over all processes.
"""

from __future__ import annotations

import builtins
import sys
from typing import Any

import grain
import numpy as np

from segpack.data import balance as balance_lib
from segpack.data import processes
from segpack.data.balance import BalanceOptions
from segpack.data.options import PipelineConfigError
from segpack.data.packed import PackedDataset
from segpack.data.position import StreamIterator, StreamPosition, StreamStateError

__all__ = ["StreamBatches", "StreamIterator", "StreamPosition", "StreamStateError"]


def _positive(name: str, value: Any) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
    raise PipelineConfigError(f"StreamBatches: {name} must be a positive int, got {value!r}")
  return int(value)


class StreamBatches(grain.MapDataset):
  """This process's part of every global batch of the row stream, from a start position.

  Algorithm for element `k` (`B` = `global_batch_size`, `Q` = `process_count`, `R` rows per
  epoch, `s` the start's stream offset):

  1. Global batch `k` is stream offsets `[s + k*B, s + (k+1)*B)`; offset `t` is row
     `perm_e[t % R]` of epoch `e = t // R`, built from epoch `e`'s plan (batches may straddle
     an epoch boundary). A finite stream (`num_epochs` epochs) ends with its last, partly
     filled batch: offsets past its end are all-padding rows.
  2. With `balance=BalanceOptions(num_ranks=N)`, the batch's offsets are reordered by
     `segpack.data.balance.assign_rows` on their rows' attention costs, so that rank `r` (which
     takes the contiguous block `[r*B/N, (r+1)*B/N)`) gets a balanced share.
  3. Process `p` takes the contiguous block `[p*B/Q, (p+1)*B/Q)` of the batch
     (`segpack.data.processes.process_block`, the rule of `pack_minibatches` too), the rows
     that `jax.make_array_from_process_local_data` places on its devices for a batch split over
     the mesh's `data` x `fsdp` devices in process order.
  4. The rows are built in one vectorized call (`PackedDataset.get_batch`).

  Worked example: R = 5, B = 4, Q = 2, start (0, 0), epoch permutations [3, 0, 4, 1, 2] and
  [1, 4, 0, 2, 3]. Batch 0 is offsets 0..3: process 0 reads rows 3, 0 and process 1 rows 4, 1.
  Batch 1 is offsets 4..7: process 0 reads row 2 of epoch 0 and row 1 of epoch 1, process 1
  rows 4 and 0 of epoch 1. Saved after batch 1, the position is (1, 3); resumed on one process
  with B = 2, batch 0 is rows 2, 3 of epoch 1: every row of epoch 1 once.

  Every element is a pure function of `k`, the start and the layout.
  """

  def __init__(self, rows: PackedDataset, *, global_batch_size: int, process_index: int,
               process_count: int, start: StreamPosition = StreamPosition(epoch=0, index=0),
               balance: BalanceOptions | None = None):
    """Creates the batches.

    Args:
      rows: the stream, a `pack_dataset(...)` (shuffled or not, `repack` either way; infinite
        for training, finite for one pass over held-out data).
      global_batch_size: rows per global batch, a multiple of `process_count`.
      process_index: this process, `0 <= process_index < process_count`.
      process_count: processes that split every global batch.
      start: the stream position of batch 0's first row.
      balance: None (stream order), or `BalanceOptions(num_ranks=N)`: every global batch is
        balanced by attention cost over the `N` data-parallel ranks (devices along the batch
        axes of the mesh, over all processes); `N` divides `global_batch_size` and is a
        multiple of `process_count`.

    Raises:
      PipelineConfigError: naming the argument that does not fit.
    """
    super().__init__()
    if not isinstance(rows, PackedDataset):
      raise PipelineConfigError(f"StreamBatches: rows must be a PackedDataset, got {rows!r}")
    self._rows = rows
    self._batch = _positive("global_batch_size", global_batch_size)
    self._index, self._count = processes.check_processes(
        "StreamBatches", process_index=process_index, process_count=process_count)
    if self._batch % self._count:
      raise PipelineConfigError(
          f"StreamBatches: global_batch_size={self._batch} is not divisible by "
          f"process_count={self._count}")
    if balance is not None:
      if not isinstance(balance, BalanceOptions):
        raise PipelineConfigError(
            f"StreamBatches: balance must be a BalanceOptions or None, got {balance!r}")
      balance.check(global_batch_size=self._batch, process_count=self._count,
                    fn="StreamBatches")
    self._balance = balance
    if (not isinstance(start, StreamPosition)
        or not 0 <= start.index < rows.rows_in_epoch(start.epoch)):
      raise PipelineConfigError(
          f"StreamBatches: start must be a StreamPosition with 0 <= index < the rows of its "
          f"epoch, got {start!r}")
    self._start = rows.epoch_start(start.epoch) + start.index
    self._end = sys.maxsize if rows.num_epochs is None else len(rows)

  def rows_in_epoch(self, epoch: int) -> int:
    """Rows of epoch `epoch` of the stream, over all processes (`PackedDataset.rows_in_epoch`:
    the plan's rows, the same for every epoch unless a mixture)."""
    return self._rows.rows_in_epoch(epoch)

  @property
  def unit(self) -> str:
    """What a position's index counts here: "rows" (of the epoch's permutation)."""
    return "rows"

  def epoch_length(self, epoch: int) -> int:
    """Rows of epoch `epoch` (the iterator state's `epoch_length`)."""
    return self.rows_in_epoch(epoch)

  @property
  def global_batch_size(self) -> int:
    return self._batch

  @property
  def local_batch_size(self) -> int:
    """Rows of every element on this process: the length of its `process_block`."""
    block = processes.process_block(self._batch, process_index=self._index,
                                    process_count=self._count)
    return block.stop - block.start

  @property
  def start(self) -> StreamPosition:
    return self._position(self._start)

  def _position(self, offset: int) -> StreamPosition:
    epoch, index = self._rows.locate(np.asarray([offset]))
    return StreamPosition(epoch=int(epoch[0]), index=int(index[0]))

  def starting_at(self, start: StreamPosition) -> "StreamBatches":
    """The same batches' layout from another start position."""
    return StreamBatches(self._rows, global_batch_size=self._batch,
                         process_index=self._index, process_count=self._count, start=start,
                         balance=self._balance)

  def position(self, k: int) -> StreamPosition:
    """The stream position of global batch `k`'s first row (= where batch `k` starts)."""
    return self._position(self._start + int(k) * self._batch)

  def global_offsets(self, k: int) -> np.ndarray:
    """int64 `[B]`: the stream offsets of global batch `k`, in the order the ranks take them."""
    if k < 0:
      raise IndexError(f"StreamBatches: negative batch index {k}")
    offsets_B = self._start + int(k) * self._batch + np.arange(self._batch, dtype=np.int64)
    if self._balance is None:
      return offsets_B
    real_B = offsets_B < self._end
    costs_B = np.zeros(self._batch, dtype=np.int64)
    costs_B[real_B] = self._rows.attention_costs(offsets_B[real_B])
    return offsets_B[balance_lib.assign_rows(costs_B, num_ranks=self._balance.num_ranks)]

  def local_offsets(self, k: int) -> np.ndarray:
    """int64 `[B / Q]`: the stream offsets of this process's rows of global batch `k`."""
    return self.global_offsets(k)[processes.process_block(
        self._batch, process_index=self._index, process_count=self._count)]

  def plan_rows(self, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`(epoch, plan row)` of each of this process's rows of batch `k` (int64 `[B / Q]` each).

    The plan row indexes epoch `epoch`'s plan (with `repack="epoch"` every epoch has its own);
    a padding row past the end of a finite stream is plan row -1.
    """
    offsets = self.local_offsets(k)
    real = offsets < self._end
    epochs = np.full(offsets.shape, -1, dtype=np.int64)
    rows = np.full(offsets.shape, -1, dtype=np.int64)
    epochs[real] = self._rows.epochs(offsets[real])
    rows[real] = self._rows.plan_rows(offsets[real])
    return epochs, rows

  def __len__(self) -> int:
    if self._end == sys.maxsize:
      return sys.maxsize
    return -(-max(self._end - self._start, 0) // self._batch)

  def __str__(self) -> str:
    return (f"StreamBatches(global_batch_size={self._batch}, process={self._index}/"
            f"{self._count}, start={self.start}, balance={self._balance})")

  def __getitem__(self, index):
    if isinstance(index, builtins.slice):
      return self.slice(index)
    with self._stats.record_self_time():
      return self._stats.record_output_spec(self._build(self.local_offsets(int(index))))

  def _build(self, offsets: np.ndarray) -> dict[str, np.ndarray]:
    """The rows at `offsets`; those past the end of a finite stream are all padding."""
    real = offsets < self._end
    if real.all():
      return self._rows.get_batch(offsets)
    out = self._rows.padding_rows(len(offsets))
    if real.any():
      for key, value in self._rows.get_batch(offsets[real]).items():
        out[key][real] = value
    return out

  def iterator(self, *, read_options: grain.ReadOptions | None = None) -> "StreamIterator":
    """A `StreamIterator` over these batches; its state is the position in rows
    (`segpack.data.position`)."""
    return StreamIterator(self, read_options=read_options)


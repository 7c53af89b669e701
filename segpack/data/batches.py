"""`PackedDataset.batch`: batches of packed rows, each built by one vectorized call."""

from __future__ import annotations

import builtins
import sys
from typing import Any

import grain
import numpy as np

from segpack.data.options import PipelineConfigError

__all__ = ["PackedBatchDataset"]


class PackedBatchDataset(grain.MapDataset):
  """Batches of a `PackedDataset`, each built by one vectorized `get_batch` call.

  Element `b` holds parent elements `[b * batch_size, (b + 1) * batch_size)` (the last batch of a
  finite parent may be short, or dropped with `drop_remainder`), exactly as Grain's
  `BatchMapDataset` groups them.
  """

  def __init__(self, parent: Any, *, batch_size: int, drop_remainder: bool):
    super().__init__(parent)
    if not isinstance(batch_size, int) or batch_size <= 0:
      raise PipelineConfigError(f"batch: batch_size must be a positive int, got {batch_size!r}")
    self._batch_size = batch_size
    self._drop_remainder = drop_remainder
    n = len(parent)
    if n >= sys.maxsize:
      self._length = sys.maxsize
    elif drop_remainder:
      self._length = n // batch_size
    else:
      self._length = -(-n // batch_size)

  def __len__(self) -> int:
    return self._length

  def __str__(self) -> str:
    return f"PackedBatchDataset(batch_size={self._batch_size})"

  def __getitem__(self, index):
    if isinstance(index, builtins.slice):
      return self.slice(index)
    parent = self._parent
    n = len(parent)
    if not self._length:
      raise IndexError("PackedBatchDataset is empty")
    epoch, b = divmod(index, self._length)
    start = b * self._batch_size
    stop = min(start + self._batch_size, n)
    if n < sys.maxsize:
      start, stop = start + epoch * n, stop + epoch * n
    with self._stats.record_self_time():
      return self._stats.record_output_spec(parent.get_batch(np.arange(start, stop)))

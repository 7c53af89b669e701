"""Padding baselines: one chunk per row (`pad`) and length-grouped padding (`sorted_pad`)."""

from __future__ import annotations

import numpy as np

from segpack.packing.runs import Placement, decreasing_order


def one_per_row(length: np.ndarray, seq_len: int) -> Placement:
  """`pad`: chunk `i` alone in row `i`."""
  del seq_len
  ids = np.arange(len(length), dtype=np.int64)
  return Placement(order=ids, bins=ids)


def sorted_one_per_row(length: np.ndarray, seq_len: int) -> Placement:
  """`sorted_pad`: one chunk per row, rows sorted by length, longest first (ties by index)."""
  return Placement(order=decreasing_order(length, seq_len),
                   bins=np.arange(len(length), dtype=np.int64))


def sorted_pad_slots(row_len: np.ndarray, *, batch_size: int, pad_multiple: int,
                     seq_len: int) -> int:
  """Slots that length-grouped padding computes on.

  `sorted_pad` rows come sorted by length, longest first; each batch of `batch_size` consecutive
  rows is padded to its longest row rounded up to a multiple of `pad_multiple` (at most
  `seq_len`), the variable-length batches a bucketing loader would feed. Its utilization is real
  tokens / sum over batches of (rows x batch length).

  Example: row lengths [9, 7, 3, 2], batch_size 2, pad_multiple 4, seq_len 16: batches are
  padded to 12 and 4 slots, so slots = 2 * 12 + 2 * 4 = 32 for 21 tokens (66%).
  """
  batch_max = row_len[::batch_size]
  batch_rows = np.minimum(batch_size, len(row_len) - np.arange(0, len(row_len), batch_size))
  batch_len = np.minimum(seq_len, -(-batch_max // pad_multiple) * pad_multiple)
  return int((batch_len * batch_rows).sum())

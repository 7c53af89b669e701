"""Slot orders that balance context-parallel attention over the devices of a row.

Context parallelism (CP) splits each row's S slots over `cp` devices: after reordering, device `d`
holds positions `[d * S / cp, (d + 1) * S / cp)`. Every device gathers all keys and values, so a
query's work does not depend on where it sits: it is the number of keys it attends to (causal,
inside its segment), its *query cost* (`segpack.data.attention_cost.query_costs`). A device's work
is the sum of its queries' costs, and the step takes as long as the busiest device. Cutting a row
into `cp` contiguous pieces puts the late slots of a long document, the expensive ones, on one
device; the orders here spread them out. The order is a permutation of slots,
`slot_index_BxS[b, j]` = the original slot of the slot now at position `j`; the attention masks
keys by `slot_index[k] <= slot_index[q]` (and equal segment ids), so the result is the same as
without reordering. Pure NumPy, vectorised: tens of milliseconds for S = 2**20, cp = 8, B = 1
(`python -m segpack bench attention --context` reports it as `order_ms`).

The orders (`CONTEXT_BALANCES`):

1. `"none"`: the identity; device `d` gets slots `[d * S / cp, (d + 1) * S / cp)`.
2. `"zigzag"`: cut the row into `2 cp` chunks of `S / (2 cp)` slots; device `i` gets chunks `i`
   and `2 cp - 1 - i`. Exact for one causal document filling the row (chunk costs then grow
   linearly), blind to where documents start.
3. `"documents"`: cut the row into `2 cp` chunks as in 2, compute each chunk's cost (the sum of
   its query costs), sort the chunks by cost (ascending, ties by chunk index) and give device
   `i` the `i`-th cheapest and the `i`-th dearest chunk. Every device holds two chunks, so the
   same number of slots; pairing the sorted costs smallest-with-largest minimises the largest
   pair sum (the classic exchange argument: swapping partners can only raise the largest sum),
   so no assignment of two chunks per device has a cheaper busiest device for that row. For one
   document filling the row (or equal chunk costs) it is exactly `"zigzag"`.

Each device's chunks stay in ascending slot order, so its slot indices ascend.

`"documents"` balances every row on its own. A batch's rows go to different data-parallel
groups (the mesh splits the batch axis), which this module does not see; a per-row optimum is
balanced whatever that split is, and a device's cost summed over its rows is at most the sum of
the per-row maxima. At the sequence lengths that need CP a group usually holds one row.

Worked example, S = 8, cp = 2, chunks of 2 slots, segment ids `[1 1 1 1 1 2 2 0]`:

- query costs `[1 2 3 4 5 1 2 0]`; chunk costs `c0..c3 = 3 7 6 2`, total 18, mean 9 per device;
- `"none"`: devices `c0 + c1 = 10`, `c2 + c3 = 8`: the largest is 10;
- `"zigzag"`: devices `c0 + c3 = 5`, `c1 + c2 = 13`: 13;
- `"documents"`: sorted `c3 c0 c2 c1`; device 0 gets `c3 + c1 = 9`, device 1 `c0 + c2 = 9`;
  `slot_index = [2 3 6 7 0 1 4 5]`.

- `context_order`, `reorder`, `device_costs`.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from segpack.data.attention_cost import query_costs
from segpack.errors import UserError

__all__ = ["CONTEXT_BALANCES", "ContextOrderError", "context_order", "device_costs", "reorder"]

CONTEXT_BALANCES = ("none", "zigzag", "documents")
SLOT_INDEX = "slot_index"


class ContextOrderError(UserError, ValueError):
  """A context-order argument is invalid; the message names it and echoes the value."""


def _check_segment_ids(segment_ids_BxS: np.ndarray, where: str) -> np.ndarray:
  seg = np.asarray(segment_ids_BxS)
  if seg.ndim != 2 or not np.issubdtype(seg.dtype, np.integer):
    raise ContextOrderError(
        f"{where}: segment_ids_BxS must be integer [B, S], got shape {seg.shape} and dtype "
        f"{seg.dtype}")
  if seg.size and seg.min() < 0:
    raise ContextOrderError(f"{where}: segment_ids_BxS has a negative id {seg.min()}")
  return seg


def _check_context_size(context_size: int, seq_len: int, chunks_per_device: int,
                        where: str) -> None:
  if isinstance(context_size, bool) or not isinstance(context_size, (int, np.integer)) or (
      context_size < 1):
    raise ContextOrderError(f"{where}: context_size must be a positive int, got "
                            f"{context_size!r}")
  if seq_len % (chunks_per_device * context_size):
    need = "2 * context_size" if chunks_per_device == 2 else "context_size"
    raise ContextOrderError(
        f"{where}: the sequence length S={seq_len} must be divisible by {need} = "
        f"{chunks_per_device * context_size}")


def _slot_index(chunk_order_BxC: np.ndarray, chunk: int) -> np.ndarray:
  """Slot indices `[B, C * chunk]` of chunks laid out in `chunk_order_BxC` order."""
  b, c = chunk_order_BxC.shape
  slots = chunk_order_BxC[:, :, None].astype(np.int64) * chunk + np.arange(chunk)
  return slots.reshape(b, c * chunk).astype(np.int32)


def context_order(*, segment_ids_BxS: np.ndarray, context_size: int,
                  balance: str) -> np.ndarray:
  """The slot order of every row for context parallelism over `context_size` devices.

  Args:
    segment_ids_BxS: integer segment ids in the original slot order, 0 on padding.
    context_size: `cp`, the devices one row is split over; device `d` takes positions
      `[d * S / cp, (d + 1) * S / cp)` of the result.
    balance: one of `CONTEXT_BALANCES` (the module docstring describes them).

  Returns:
    int32 `[B, S]` `slot_index`: a permutation of `0..S-1` per row, `slot_index[b, j]` the
    original slot now at position `j`, ascending within every device's positions.

  Raises:
    ContextOrderError: `balance` is unknown, `S` is not divisible by `2 * context_size` (by
      `context_size` for `"none"`), or the segment ids are not integer `[B, S]`.
  """
  if balance not in CONTEXT_BALANCES:
    raise ContextOrderError(f"context_order: balance must be one of {CONTEXT_BALANCES}, got "
                            f"{balance!r}")
  seg = _check_segment_ids(segment_ids_BxS, "context_order")
  b, s = seg.shape
  _check_context_size(context_size, s, 1 if balance == "none" else 2, "context_order")
  if balance == "none":
    return np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
  cp = int(context_size)
  num_chunks, chunk = 2 * cp, s // (2 * cp)
  if balance == "zigzag":
    ranked_BxC = np.broadcast_to(np.arange(num_chunks), (b, num_chunks))
  else:
    chunk_cost_BxC = query_costs(seg).reshape(b, num_chunks, chunk).sum(axis=2)
    ranked_BxC = np.argsort(chunk_cost_BxC, axis=1, kind="stable")  # cheapest first
  # Device i: the i-th cheapest and the i-th dearest chunk (for zigzag: chunks i and 2cp-1-i).
  pairs_BxPx2 = np.stack([ranked_BxC[:, :cp], ranked_BxC[:, ::-1][:, :cp]], axis=2)
  pairs_BxPx2 = np.sort(pairs_BxPx2, axis=2)  # each device's chunks in ascending slot order
  return _slot_index(pairs_BxPx2.reshape(b, num_chunks), chunk)


def _check_slot_index(slot_index_BxS: np.ndarray, shape: tuple[int, ...] | None,
                      where: str) -> np.ndarray:
  index = np.asarray(slot_index_BxS)
  if index.ndim != 2 or not np.issubdtype(index.dtype, np.integer):
    raise ContextOrderError(f"{where}: slot_index_BxS must be integer [B, S], got shape "
                            f"{index.shape} and dtype {index.dtype}")
  if shape is not None and index.shape != shape:
    raise ContextOrderError(f"{where}: slot_index_BxS has shape {index.shape}, the segment ids "
                            f"{shape}")
  if index.size and not np.array_equal(np.sort(index, axis=1),
                                       np.broadcast_to(np.arange(index.shape[1]), index.shape)):
    raise ContextOrderError(f"{where}: slot_index_BxS is not a permutation of 0..S-1 in every "
                            f"row")
  return index


def reorder(features: Mapping[str, np.ndarray], *,
            slot_index_BxS: np.ndarray) -> dict[str, np.ndarray]:
  """Every per-slot feature of a batch in context order, and the order itself.

  Arrays whose leading dimensions are `[B, S]` (ids, labels, segment ids, positions, loss
  weights, ...) are gathered along the slot axis, as NumPy arrays: `out[k][b, j] =
  features[k][b, slot_index[b, j]]`. Positions therefore keep their original values (RoPE is
  unchanged). Anything else passes through unchanged. The result also holds `"slot_index"`,
  what the attention's causal mask compares.

  Args:
    features: the batch, name -> array.
    slot_index_BxS: from `context_order`.

  Returns:
    A new dict: the reordered features and `"slot_index"` (int32 `[B, S]`).

  Raises:
    ContextOrderError: `features` already holds `"slot_index"` (the batch is already reordered)
      or `slot_index_BxS` is not a permutation per row.
  """
  if SLOT_INDEX in features:
    raise ContextOrderError(f"reorder: features already hold {SLOT_INDEX!r}; the batch is "
                            f"already in context order")
  index = _check_slot_index(slot_index_BxS, None, "reorder")
  out: dict[str, np.ndarray] = {}
  for name, value in features.items():
    shape = tuple(getattr(value, "shape", ()))
    if len(shape) >= 2 and shape[:2] == index.shape:  # NumPy or any array type NumPy reads
      gather = index.reshape(index.shape + (1,) * (len(shape) - 2))
      out[name] = np.take_along_axis(np.asarray(value), gather, axis=1)
    else:
      out[name] = value
  out[SLOT_INDEX] = index.astype(np.int32)
  return out


def device_costs(*, segment_ids_BxS: np.ndarray, slot_index_BxS: np.ndarray,
                 context_size: int) -> np.ndarray:
  """The attention cost of every device of every row: the sum of its queries' costs.

  Args:
    segment_ids_BxS: integer segment ids in the original slot order, 0 on padding.
    slot_index_BxS: the order, from `context_order`.
    context_size: `cp`; device `d` holds positions `[d * S / cp, (d + 1) * S / cp)`.

  Returns:
    int64 `[B, cp]`; sum over axis 0 for a device's cost over the rows it processes.

  Raises:
    ContextOrderError: mismatched shapes, a `slot_index_BxS` that is not a permutation per row,
      or `S` not divisible by `context_size`.
  """
  seg = _check_segment_ids(segment_ids_BxS, "device_costs")
  index = _check_slot_index(slot_index_BxS, seg.shape, "device_costs")
  b, s = seg.shape
  _check_context_size(context_size, s, 1, "device_costs")
  placed_BxS = np.take_along_axis(query_costs(seg), index.astype(np.int64), axis=1)
  return placed_BxS.reshape(b, int(context_size), s // int(context_size)).sum(axis=2)

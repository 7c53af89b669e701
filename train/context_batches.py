"""Context-parallel slot order of the trainer's batches (`mesh.context`, `packing.context_balance`).

With `mesh.context = cp > 1` every row's S slots are split over `cp` devices, device `d` holding
positions `[d * S / cp, (d + 1) * S / cp)`. Before a batch goes to the devices its slots are put in
the order of `segpack.data.context_order.context_order` (balancing the causal attention work of the
devices) by `reorder`, which moves every `[B, S]` feature (ids, labels, segment ids, positions,
sources) and adds `"slot_index"`, each slot's index in the row before reordering. Only attention
reads `slot_index` (its causal mask compares slot indices); RoPE reads `segment_positions`, which
travel with their tokens, and the loss sums over all slots, so the step computes what it would
compute on the batch in row order.

The order is a function of the batch's segment ids alone, applied after the data pipeline: the
data position in a checkpoint, the batch fingerprints (`train.data.fingerprint` undoes the order)
and the data a resumed run sees do not depend on `mesh.context` or the balance.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import grain
import numpy as np

from segpack.data import context_order as order_lib

SLOT_INDEX = order_lib.SLOT_INDEX


@dataclasses.dataclass(frozen=True)
class ContextOrder:
  """How batches are reordered: `size` devices per row (1: never), `balance` one of
  `segpack.data.context_order.CONTEXT_BALANCES`."""

  size: int = 1
  balance: str = "documents"

  @property
  def active(self) -> bool:
    """Whether batches are reordered (`size > 1`)."""
    return self.size > 1

  def apply(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`batch` in context order with `"slot_index"` added; unchanged when not `active`."""
    if not self.active:
      return batch
    slot_index_BxS = order_lib.context_order(
        segment_ids_BxS=np.asarray(batch["segment_ids"]), context_size=self.size,
        balance=self.balance)
    return order_lib.reorder(batch, slot_index_BxS=slot_index_BxS)


def row_order(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A batch back in row order, without `"slot_index"` (the inverse of `ContextOrder.apply`;
  a batch without `"slot_index"` is returned as it is)."""
  if SLOT_INDEX not in batch:
    return batch
  slot_index_BxS = np.asarray(batch[SLOT_INDEX]).astype(np.int64)
  out = {}
  for name, value in batch.items():
    if name == SLOT_INDEX:
      continue
    value = np.asarray(value)
    if value.ndim >= 2 and value.shape[:2] == slot_index_BxS.shape:
      restored = np.empty_like(value)
      index = slot_index_BxS.reshape(slot_index_BxS.shape + (1,) * (value.ndim - 2))
      np.put_along_axis(restored, np.broadcast_to(index, value.shape), value, axis=1)
      value = restored
    out[name] = value
  return out


class OrderedIterator:
  """A training-batch iterator whose batches come out in context order.

  `get_state`, `set_state` and `last_plan_rows` are the wrapped iterator's: the order changes no
  data position.
  """

  def __init__(self, parent: grain.DatasetIterator, *, order: ContextOrder):
    self.parent = parent
    self.order = order

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return self.order.apply(next(self.parent))

  def get_state(self) -> dict[str, Any]:
    """The wrapped iterator's data position."""
    return self.parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    """Moves the wrapped iterator to a data position."""
    self.parent.set_state(state)

  @property
  def last_plan_rows(self) -> Any:
    """The wrapped iterator's plan rows of the last batch (None where it has none)."""
    return getattr(self.parent, "last_plan_rows", None)


class OrderedBatches(grain.MapDataset):
  """Held-out batches (`len`, `[i]`) in context order."""

  def __init__(self, parent: grain.MapDataset, *, order: ContextOrder):
    super().__init__(parent)
    self.order = order

  def __len__(self) -> int:
    return len(self._parent)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    return self.order.apply(self._parent[index])

  def __str__(self) -> str:
    return f"OrderedBatches(size={self.order.size}, balance={self.order.balance!r})"

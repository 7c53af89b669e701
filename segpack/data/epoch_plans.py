"""The plan of every epoch when epochs differ, planned ahead in a thread.

A planner gives the plan of each epoch, a pure function of `(seed, epoch)`:
- `segpack.packing.RepackPlanner` (`pack_dataset(repack="epoch")`): epoch 0 reads the fixed
  (cached) plan; epoch `e >= 1` its own exact plan, `segpack.packing.plan(..., tie_seed=(seed,
  e))`, whose rows have the same piece lengths as the fixed plan's.
- `MixturePlanner` (`pack_dataset(Mixture(...))`, `segpack stats` on a mixture): every epoch
  draws its own documents (`segpack.data.mixture`) and plans them, so its row count is its own.

`EpochBuilders` hands out the row builder of each epoch and plans the next epoch in a daemon
thread while the current one is read.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from segpack import packing
from segpack.data import mixture as mixture_lib
from segpack.data import rows as rows_lib
from segpack.data.options import SpecialTokens
from segpack.packing.options import PlanOptions

__all__ = ["EpochBuilders", "MixturePlanner"]


@dataclasses.dataclass(frozen=True)
class MixturePlanner:
  """Each mixture epoch: its draw, planned by `PlanOptions.plan` (capped at the options'
  `max_segments_per_row` when set). Every epoch is a pure function of `(seed, epoch)`.

  Attributes:
    draws: the mixture's draws (`MixtureDraws`, seeded).
    options: the packing settings (`segpack.packing.PlanOptions`).
    special: the row builder's special tokens; every document adds its `extra_tokens` slots.
    loss_mask: whether the row builder applies the sources' loss masks.
  """

  draws: mixture_lib.MixtureDraws
  options: PlanOptions
  special: SpecialTokens
  loss_mask: bool

  def plan(self, epoch: int) -> tuple[mixture_lib.Draw, packing.Plan]:
    """The draw of `epoch` and its plan (document ids index `draw.documents`)."""
    draw = self.draws.draw(epoch)
    return draw, self.options.plan(draw.documents.lengths,
                                   extra_tokens=self.special.extra_tokens)

  def builder(self, epoch: int) -> rows_lib.RowBuilder:
    """The row builder of `epoch`: its plan over its drawn documents."""
    draw, plan = self.plan(epoch)
    documents = draw.documents
    return rows_lib.RowBuilder(
        documents, plan, special=self.special, doc_lengths=documents.lengths,
        loss_mask=self.loss_mask,
        doc_sources=documents.parent_index if self.draws.segment_sources else None)


class EpochBuilders:
  """The row builder of every epoch: the fixed plan's, or each epoch's own with a planner.

  1. Without a planner, every epoch reads the fixed plan's builder.
  2. With one, epoch 0 reads the fixed plan and epoch `e >= 1` a builder over `planner.plan(e)` (a
     `RepackPlanner`: the fixed builder over the epoch's plan; a `MixturePlanner`: a builder over
     the epoch's drawn documents). The first use of epoch `e` starts planning epoch `e + 1` in a
     daemon thread, so the next epoch's first batch finds its plan ready (or waits only for the
     rest).
  3. Epoch 0's builder and the three newest others (the last two epochs read and the one planned
     ahead) are kept. A background plan that failed is planned again in the foreground, where
     its error is raised.

  Example: reading epochs 0, 0, 1 plans epoch 1 in the background at the first read of epoch 0,
  and epoch 2 at the first read of epoch 1.
  """

  def __init__(self, fixed: rows_lib.RowBuilder, *,
               planner: packing.RepackPlanner | MixturePlanner | None,
               num_epochs: int | None):
    self._fixed = fixed
    self._planner = planner
    self._num_epochs = num_epochs
    self._builders: dict[int, rows_lib.RowBuilder] = {0: fixed}
    self._pending: dict[int, threading.Thread] = {}
    self._lock = threading.Lock()

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    state["_builders"] = {0: self._fixed}
    state["_pending"] = {}
    del state["_lock"]
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._lock = threading.Lock()

  @property
  def fixed(self) -> rows_lib.RowBuilder:
    """The fixed plan's builder (epoch 0's)."""
    return self._fixed

  @property
  def repacks(self) -> bool:
    """Whether epochs have plans of their own."""
    return self._planner is not None

  @property
  def same_rows(self) -> bool:
    """Whether every epoch has the fixed plan's rows (else each epoch its own row count)."""
    return not isinstance(self._planner, MixturePlanner)

  def rows_in_epoch(self, epoch: int) -> int:
    """Rows of `epoch`'s plan."""
    return self._fixed.num_rows if self.same_rows else self.builder(epoch).num_rows

  def builder(self, epoch: int) -> rows_lib.RowBuilder:
    """The row builder of `epoch`'s plan."""
    if self._planner is None:
      return self._fixed
    if epoch == 0:
      self._plan_ahead(1)
      return self._fixed
    with self._lock:
      builder = self._builders.get(epoch)
      thread = None if builder is not None else self._pending.get(epoch)
    if builder is None:
      if thread is not None:
        thread.join()
        with self._lock:
          builder = self._builders.get(epoch)
      if builder is None:  # not planned ahead, or the background plan failed: plan here
        builder = self._build(epoch)
      self._keep(epoch, builder)
    self._plan_ahead(epoch + 1)
    return builder

  def _build(self, epoch: int) -> rows_lib.RowBuilder:
    """The builder of `epoch` (>= 1) from the planner."""
    if isinstance(self._planner, MixturePlanner):
      return self._planner.builder(epoch)
    return self._fixed.with_plan(self._planner.plan(epoch))

  def _keep(self, epoch: int, builder: rows_lib.RowBuilder) -> None:
    with self._lock:
      self._pending.pop(epoch, None)
      self._builders[epoch] = builder
      others = sorted(e for e in self._builders if e != 0)
      for e in others[:-3]:
        del self._builders[e]

  def _plan_ahead(self, epoch: int) -> None:
    """Starts planning `epoch` in a daemon thread unless it is planned or being planned."""
    if self._num_epochs is not None and epoch >= self._num_epochs:
      return
    with self._lock:
      if epoch in self._builders or epoch in self._pending:
        return
      thread = threading.Thread(target=self._plan_in_background, args=(epoch,), daemon=True,
                                name=f"segpack-repack-epoch-{epoch}")
      self._pending[epoch] = thread
      # Started under the lock: another reader that finds it pending may join it at once.
      thread.start()

  def _plan_in_background(self, epoch: int) -> None:
    try:
      builder = self._build(epoch)
    except Exception:  # pylint: disable=broad-except
      return  # `builder` plans it again in the foreground and raises there
    self._keep(epoch, builder)

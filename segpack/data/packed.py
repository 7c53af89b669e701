"""`pack_dataset`: a Grain `MapDataset` of packed, segment-annotated rows.

The packing plan is computed once per data set (or loaded from the plan cache); the dataset then
maps a global step index to (epoch, row of this process) and builds that row from memory-mapped
token slices. Everything is a pure function of the index, so Grain's iterator checkpoints
(`get_state` / `set_state`) resume exactly, and `.batch`, `.to_iter_dataset`, `.mp_prefetch`
compose as with any `MapDataset`.
"""

from __future__ import annotations

import builtins
import dataclasses
import os
import sys
import threading
from typing import Any, Sequence

import grain
import numpy as np

from segpack import packing
from segpack.data import balance as balance_lib
from segpack.data import minibatch_dataset as minibatch_lib
from segpack.data import rows as rows_lib
from segpack.data import options
from segpack.data import sources
from segpack.data.options import LongDocs, PipelineConfigError, SpecialTokens
from segpack.data.permutation import epoch_permutation

REPACK_MODES = ("none", "epoch")


@dataclasses.dataclass(frozen=True)
class EpochPlanner:
  """What `repack="epoch"` needs to plan epoch `e`: `packing.plan(..., tie_seed=(seed, e))`.

  Epoch 0 is the fixed (cached) plan; every plan is a pure function of `(seed, epoch)`.
  """

  lengths: np.ndarray
  seed: int
  plan_kwargs: dict[str, Any]

  def __post_init__(self):
    # The chunks and rows are the same every epoch: computed once (on first use), then shared.
    object.__setattr__(self, "_planner", packing.TiePlanner(self.lengths, **self.plan_kwargs))

  def plan(self, epoch: int) -> packing.Plan:
    return self._planner.plan((self.seed, int(epoch)))


__all__ = ["EpochPlanner", "LongDocs", "PackedBatchDataset", "PackedDataset", "PipelineConfigError",
           "SpecialTokens", "pack_dataset"]


class PackedDataset(grain.MapDataset):
  """Packed rows, shuffled per epoch, split across processes, as a random-access dataset.

  Algorithm for element `i` of process `shard_index` out of `shard_count`:

  1. The plan has `R` rows per epoch. It is padded with all-padding rows to
     `R' = shard_count * ceil(R / shard_count)` (or cut to `shard_count * floor(R / shard_count)`
     with `drop_remainder`), so every process gets `P = R' / shard_count` rows per epoch.
  2. `epoch, j = divmod(i, P)`; the epoch's global position is `g = j * shard_count + shard_index`
     (processes interleave, so the processes' step-`j` rows are consecutive epoch rows).
  3. The epoch's row order is a permutation of the `R` plan rows drawn from a generator seeded by
     `(seed, epoch)` (identity without `shuffle`); positions `g >= R` are all-padding rows.
  4. With `balance`, every consecutive group of `balance.global_batch_size` epoch positions
     (one optimizer step of the trainer) is reordered within itself by
     `segpack.data.balance.balance_epoch`, so the data-parallel ranks' attention costs are
     balanced; a last, shorter group keeps its order.
  5. The row is built by `segpack.data.rows.RowBuilder` over the plan of the epoch: the one
     plan, or with `epoch_planner` (`repack="epoch"`) epoch `e`'s own plan, whose rows have the
     same lengths as the fixed plan's (so `R` and the row costs are the same every epoch).

  Example: R = 5 rows, shard_count 2, so R' = 6 and P = 3; with epoch permutation [3, 0, 4, 1, 2],
  process 0 reads rows 3, 4, 2 and process 1 reads rows 0, 1 and a padding row; element 3 of
  process 0 is the first row of epoch 1's permutation.

  `num_epochs=None` makes the dataset infinite (`len == sys.maxsize`, as Grain's `repeat()`);
  otherwise `len == num_epochs * P` and indices wrap around modulo the length.

  The per-process split depends on `shard_count`, so an iterator state of this dataset resumes
  only on the same process count. For training that may resume on another one, read the whole
  stream (`shard_count=1`) through `segpack.data.stream.StreamBatches` instead.

  `max_segments_in_row` is the most segments (plan pieces) in any row of the plan, over all
  processes, after any `max_segments_per_row` cap: every process reads the same value, the static
  bound a segment-count-shaped kernel (cuDNN's packed layout) needs.
  """

  def __init__(self, builder: rows_lib.RowBuilder, *, seed: int, shuffle: bool,
               num_epochs: int | None, shard_index: int, shard_count: int,
               max_segments_in_row: int, drop_remainder: bool = False,
               balance: balance_lib.BalanceOptions | None = None,
               row_costs: np.ndarray | None = None,
               epoch_planner: EpochPlanner | None = None,
               plan: packing.Plan | None = None):
    super().__init__()
    self._plan = plan
    self._epoch_planner = epoch_planner
    self._builders: dict[int, rows_lib.RowBuilder] = {0: builder}
    self._pending: dict[int, threading.Thread] = {}
    self._plan_lock = threading.Lock()
    self._balance = balance
    self._row_costs = row_costs
    self._builder = builder
    self._max_segments_in_row = int(max_segments_in_row)
    self._seed = seed
    self._shuffle = shuffle
    self._num_epochs = num_epochs
    self._shard_index = shard_index
    self._shard_count = shard_count
    rows = builder.num_rows
    if drop_remainder:
      self._rows_per_process = rows // shard_count
    else:
      self._rows_per_process = -(-rows // shard_count)
    if num_epochs is None:
      self._length = sys.maxsize if self._rows_per_process else 0
    else:
      self._length = num_epochs * self._rows_per_process
    self._perm_cache: dict[int, np.ndarray] = {}
    self._perm_lock = threading.Lock()

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    state["_perm_cache"] = {}
    state["_builders"] = {0: self._builder}
    state["_pending"] = {}
    del state["_perm_lock"], state["_plan_lock"]
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._perm_lock = threading.Lock()
    self._plan_lock = threading.Lock()

  def epoch_builder(self, epoch: int) -> rows_lib.RowBuilder:
    """The row builder of `epoch`'s plan (the one plan unless `repack="epoch"`).

    With `repack="epoch"`, the last two epochs' builders are kept, and the first use of epoch
    `e` starts planning epoch `e + 1` in a background thread, so the next epoch's first step
    finds its plan ready (or waits only for the rest of it).
    """
    if self._epoch_planner is None or epoch == 0:
      if self._epoch_planner is not None:
        self._plan_ahead(1)
      return self._builder
    with self._plan_lock:
      builder = self._builders.get(epoch)
      thread = None if builder is not None else self._pending.get(epoch)
    if builder is None:
      if thread is None:
        builder = self._builder.with_plan(self._epoch_planner.plan(epoch))
      else:
        thread.join()
        with self._plan_lock:
          builder = self._builders.get(epoch)
        if builder is None:  # the background plan failed: plan here, raising its error
          builder = self._builder.with_plan(self._epoch_planner.plan(epoch))
      self._keep(epoch, builder)
    self._plan_ahead(epoch + 1)
    return builder

  def _keep(self, epoch: int, builder: rows_lib.RowBuilder) -> None:
    """Stores `epoch`'s builder, keeping epoch 0's and the three newest others (the last two
    epochs read and the one planned ahead)."""
    with self._plan_lock:
      self._pending.pop(epoch, None)
      self._builders[epoch] = builder
      others = sorted(e for e in self._builders if e != 0)
      for e in others[:-3]:
        del self._builders[e]

  def _plan_ahead(self, epoch: int) -> None:
    """Starts planning `epoch` in a daemon thread unless it is planned or being planned."""
    if self._num_epochs is not None and epoch >= self._num_epochs:
      return
    with self._plan_lock:
      if epoch in self._builders or epoch in self._pending:
        return
      thread = threading.Thread(target=self._plan_in_background, args=(epoch,), daemon=True,
                                name=f"segpack-repack-epoch-{epoch}")
      self._pending[epoch] = thread
      # Started under the lock: another reader that finds it pending may join it at once.
      thread.start()

  def _plan_in_background(self, epoch: int) -> None:
    try:
      builder = self._builder.with_plan(self._epoch_planner.plan(epoch))
    except Exception:  # pylint: disable=broad-except
      return  # `epoch_builder` plans it again in the foreground and raises there
    self._keep(epoch, builder)

  @property
  def seq_len(self) -> int:
    return self._builder.seq_len

  @property
  def max_segments_in_row(self) -> int:
    """The most segments in any row of the plan (all processes, after the cap; 0 if empty).

    Rows hold their segments as ids 1..n, so no row this dataset yields has a larger
    `segment_ids.max()`. For cuDNN pass
    `segpack.attention.cudnn.cudnn_segment_bound(max_segments_in_row)` as `max_segments_per_row`.
    """
    return self._max_segments_in_row

  @property
  def num_plan_rows(self) -> int:
    """Rows of one epoch over all processes (before padding to a multiple of shard_count)."""
    return self._builder.num_rows

  @property
  def rows_per_epoch(self) -> int:
    """Rows one process reads per epoch."""
    return self._rows_per_process

  @property
  def shard_count(self) -> int:
    """Processes the epochs are split over (1: this dataset is the whole row stream)."""
    return self._shard_count

  @property
  def num_epochs(self) -> int | None:
    """Epochs (None: infinite)."""
    return self._num_epochs

  @property
  def balance(self) -> balance_lib.BalanceOptions | None:
    """The epoch-aligned balancing option, or None."""
    return self._balance

  def row_attention_costs(self) -> np.ndarray:
    """int64 `[num_plan_rows]`: `segpack.data.balance.row_attention_cost` of every plan row.

    The same for every epoch's plan with `repack="epoch"` (its rows have the same piece
    lengths). Computed on first use and kept (8 bytes per plan row).
    """
    if self._row_costs is None:
      if self._plan is None:
        raise PipelineConfigError(
            "PackedDataset.row_attention_costs: this dataset was built without its plan; "
            "build it with segpack.pack_dataset")
      self._row_costs = balance_lib.row_attention_cost(self._plan)
    return self._row_costs

  def __len__(self) -> int:
    return self._length

  def __str__(self) -> str:
    return (f"PackedDataset(seq_len={self.seq_len}, plan_rows={self.num_plan_rows}, "
            f"rows_per_epoch={self._rows_per_process}, num_epochs={self._num_epochs}, "
            f"shard={self._shard_index}/{self._shard_count})")

  def _permutation(self, epoch: int) -> np.ndarray:
    """The row order of `epoch` (the last two epochs' orders are kept; thread-safe)."""
    with self._perm_lock:
      perm = self._perm_cache.get(epoch)
      if perm is None:
        perm = epoch_permutation(self._builder.num_rows, seed=self._seed, epoch=epoch)
        if len(self._perm_cache) >= 2:
          self._perm_cache.pop(next(iter(self._perm_cache)))
        self._perm_cache[epoch] = perm
      return perm

  def _balanced_rows(self, epoch: int) -> np.ndarray:
    """The plan row at each epoch position (-1: padding), balanced by `self._balance`."""
    with self._perm_lock:
      rows = self._perm_cache.get(epoch)
    if rows is not None:
      return rows
    num_rows = self._builder.num_rows
    padded = self._rows_per_process * self._shard_count
    order = (epoch_permutation(num_rows, seed=self._seed, epoch=epoch) if self._shuffle
             else np.arange(num_rows, dtype=np.int64))
    rows = np.full(padded, rows_lib.PADDING_ROW, dtype=np.int64)
    rows[:min(padded, num_rows)] = order[:padded]
    costs = np.where(rows >= 0, self._row_costs[np.maximum(rows, 0)], 0)
    rows = balance_lib.balance_epoch(rows, costs, options=self._balance,
                                     shard_count=self._shard_count)
    with self._perm_lock:
      if len(self._perm_cache) >= 2:
        self._perm_cache.pop(next(iter(self._perm_cache)))
      self._perm_cache[epoch] = rows
    return rows

  def _plan_row(self, index: int) -> int:
    """`plan_rows` for one index, with Python integers (the per-element path)."""
    index = int(index)
    if not self._length:
      raise IndexError(f"PackedDataset is empty; index {index} is out of range")
    if self._num_epochs is not None:
      index %= self._length
    elif index < 0:
      raise IndexError(f"negative index into an infinite PackedDataset: {index}")
    epoch, j = divmod(index, self._rows_per_process)
    g = j * self._shard_count + self._shard_index
    if self._balance is not None:
      return int(self._balanced_rows(epoch)[g])
    if g >= self._builder.num_rows:
      return rows_lib.PADDING_ROW
    return int(self._permutation(epoch)[g]) if self._shuffle else g

  def plan_rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """Maps element indices of this dataset to plan row indices (-1: an all-padding row).

    Args:
      indices: element indices (non-negative, or negative from the end of a finite dataset).

    Returns:
      int64 array of plan rows, the same shape as `indices`.
    """
    idx = np.asarray(indices, dtype=np.int64)
    if not self._length:
      raise IndexError(f"PackedDataset is empty; index {indices!r} is out of range")
    if self._num_epochs is not None:
      idx = idx % self._length
    elif (idx < 0).any():
      raise IndexError(f"negative index into an infinite PackedDataset: {indices!r}")
    epoch, j = np.divmod(idx, self._rows_per_process)
    g = j * self._shard_count + self._shard_index
    out = np.full(idx.shape, rows_lib.PADDING_ROW, dtype=np.int64)
    if self._balance is not None:
      for e in np.unique(epoch).tolist():
        sel = epoch == e
        out[sel] = self._balanced_rows(e)[g[sel]]
      return out
    real = g < self._builder.num_rows
    for e in np.unique(epoch[real]).tolist():
      sel = real & (epoch == e)
      out[sel] = self._permutation(e)[g[sel]] if self._shuffle else g[sel]
    return out

  def __getitem__(self, index):
    if isinstance(index, builtins.slice):
      return self.slice(index)
    with self._stats.record_self_time():
      row = self._plan_row(index)
      builder = (self._builder if self._epoch_planner is None
                 else self.epoch_builder(int(self._epochs(np.asarray([index]))[0])))
      return self._stats.record_output_spec(builder.build_row(row))

  def _getitems(self, indices: Sequence[int]):
    features = self.get_batch(list(indices))
    return [{k: v[n] for k, v in features.items()} for n in range(len(indices))]

  def _epochs(self, indices: np.ndarray) -> np.ndarray:
    """The epoch of each element index (after wrapping a finite dataset)."""
    idx = np.asarray(indices, dtype=np.int64)
    if self._num_epochs is not None:
      idx = idx % self._length
    return idx // self._rows_per_process

  def get_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """Builds the rows of `indices` at once, as int32 `[len(indices), seq_len]` arrays.

    This is the fast path (one vectorized build per batch, one per epoch of a batch that
    spans epochs with `repack="epoch"`); `batch()` uses it.
    """
    rows = self.plan_rows(indices)
    if self._epoch_planner is None:
      return self._builder.build(rows)
    epochs = self._epochs(indices)
    parts = {int(e): self.epoch_builder(int(e)).build(rows[epochs == e])
             for e in np.unique(epochs).tolist()}
    if len(parts) == 1:
      return next(iter(parts.values()))
    first = next(iter(parts.values()))
    out = {k: np.empty((len(rows),) + v.shape[1:], v.dtype) for k, v in first.items()}
    for e, features in parts.items():
      for k, v in features.items():
        out[k][epochs == e] = v
    return out

  def batch(self, batch_size: int, *, drop_remainder: bool = False,
            batch_fn=None) -> grain.MapDataset:
    """Like `grain.MapDataset.batch`, with a vectorized path when `batch_fn` is None.

    The result equals `grain.MapDataset.batch` on this dataset (same elements, same grouping;
    each pass over a finite dataset is batched on its own), but every batch is built with one
    vectorized call instead of `batch_size` row builds and a stack.
    """
    if batch_fn is not None:
      return super().batch(batch_size, drop_remainder=drop_remainder, batch_fn=batch_fn)
    return PackedBatchDataset(self, batch_size=batch_size, drop_remainder=drop_remainder)


class PackedBatchDataset(grain.MapDataset):
  """Batches of a `PackedDataset`, each built by one vectorized `get_batch` call.

  Element `b` holds parent elements `[b * batch_size, (b + 1) * batch_size)` (the last batch of a
  finite parent may be short, or dropped with `drop_remainder`), exactly as Grain's
  `BatchMapDataset` groups them.
  """

  def __init__(self, parent: PackedDataset, *, batch_size: int, drop_remainder: bool):
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


def _make_plan(lengths: np.ndarray, *, source: Any, seq_len: int, strategy: str,
               long_docs: str, min_len: int, overlap: int, extra: int,
               max_segments_per_row: int | None,
               plan_cache_dir: str | os.PathLike | None) -> packing.Plan:
  """The plan of the source's documents, capped at `max_segments_per_row`, from the plan cache
  or computed and cached (`segpack.packing.load_or_plan`).

  The cache is keyed by the source's fingerprint (a hash of the lengths when it has none) and all
  packing parameters; for a shard directory it defaults to `<dataset dir>/plans`.
  """
  fingerprint = getattr(source, "fingerprint", None)
  if plan_cache_dir is None and fingerprint is not None:
    root = getattr(source, "path", None) or getattr(source, "root", None)
    if root is not None:
      plan_cache_dir = os.path.join(os.fspath(root), "plans")
  return packing.load_or_plan(
      lengths, seq_len, cache_dir=plan_cache_dir,
      key=None if fingerprint is None else str(fingerprint), strategy=strategy,
      long_docs=long_docs, min_len=min_len, overlap=overlap, extra_tokens=extra,
      max_segments_per_row=max_segments_per_row)


def _max_pieces_per_row(plan: packing.Plan) -> int:
  """The most pieces (segments) in any plan row; 0 for an empty plan."""
  counts = np.diff(np.asarray(plan.row_splits, dtype=np.int64))
  return int(counts.max(initial=0))


def pack_dataset(
    source: Any,
    *,
    seq_len: int,
    strategy: str = "ffd",
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    special_tokens: SpecialTokens = options.DEFAULT_SPECIAL_TOKENS,
    long_docs: LongDocs = options.DEFAULT_LONG_DOCS,
    max_segments_per_row: int | None = None,
    shard_options: grain.sharding.ShardOptions | None = None,
    loss_mask: bool | None = None,
    plan_cache_dir: str | os.PathLike | None = None,
    balance: balance_lib.BalanceOptions | None = None,
    repack: str = "none",
    **deprecated: Any,
) -> PackedDataset:
  """Packs the documents of `source` into rows: a `PackedDataset` (a `grain.MapDataset`).

  Every element is a dict of int32 `[seq_len]` arrays `input_ids`, `labels`, `segment_ids`,
  `segment_positions` (docs/architecture.md, "Rows"). The algorithm:

  1. Every document becomes a virtual sequence `[BOS] + tokens + [EOS]` (as `special_tokens`
     says); documents with fewer than `long_docs.min_len` tokens are dropped, and one longer
     than a row is split into chunks of `seq_len` slots, consecutive chunks repeating
     `long_docs.overlap` slots (or, with `long_docs.mode="truncate"`, cut to its first chunk).
  2. `strategy` packs the pieces into rows once for the whole data set: the plan, cached on
     disk (beside the shards for a dataset directory, else in `plan_cache_dir`). With
     `max_segments_per_row`, pieces beyond the cap move to other rows.
     With `repack="epoch"` every later epoch packs them again, equal lengths in a seeded order.
  3. Each epoch is a permutation of the plan's rows seeded by `(seed, epoch)` (plan order
     without `shuffle`), so no row mixes epochs.
  4. Each process reads every `shard_count`-th row of the epoch from its `shard_index`; the
     epoch is padded with all-padding rows to a multiple of `shard_count` (or cut with
     `shard_options.drop_remainder`). `PackedDataset` documents the index arithmetic.
  5. A row's slots are its pieces' virtual slots, back to back, then padding (`pad_id`):
     `segment_ids` number the pieces 1..n, `segment_positions` count from 0 in each piece, and
     `labels` are the next slot's token within a piece (-100 on a piece's last slot, on
     padding, on repeated overlap slots, and where the source's loss mask is 0).

  Tiny example: seq_len 8, BOS 1, EOS 2, documents [5, 6, 7] and [8] (virtual lengths 5 and 3)
  fill one row: `input_ids = [1 5 6 7 2 1 8 2]`, `segment_ids = [1 1 1 1 1 2 2 2]`,
  `segment_positions = [0 1 2 3 4 0 1 2]`, `labels = [5 6 7 2 -100 8 2 -100]`.

  Deprecated keywords (until the next release, each with a DeprecationWarning naming the
  replacement): `add_bos`, `add_eos`, `bos_id`, `eos_id`, `pad_id` (use `special_tokens`);
  `long_docs` as a string, `min_len`, `overlap` (use `long_docs=LongDocs(...)`); `shard_index`,
  `shard_count` (use `shard_options`); `mode="minibatch"` with `examples_per_batch`,
  `tokens_per_batch`, `rows_per_batch`, `drop_remainder` (use `pack_minibatches`).
  `mode="minibatch"` is the only call that returns another type (a `MinibatchPackedDataset`);
  it goes away with the deprecated keywords.

  Args:
    source: a dataset directory, a `segpack.ShardSource`, or any random-access sequence of 1-D
      integer arrays (a `grain.MapDataset` included).
    seq_len: slots per row.
    strategy: planner, one of `segpack.packing.STRATEGIES` ("ffd", "bfd", "greedy", "pad",
      "sorted_pad").
    seed: shuffling seed; epoch `e` uses a generator seeded by `(seed, e)`.
    shuffle: shuffle the row order of every epoch (else plan order).
    num_epochs: None for an infinite dataset, else the number of epochs.
    special_tokens: BOS/EOS insertion and the BOS/EOS/padding ids; None ids come from the
      source's tokenizer.
    long_docs: splitting or truncating long documents, chunk overlap, the minimum length.
    max_segments_per_row: cap on segments per row (pieces beyond it go to other rows); the
      result's `max_segments_in_row` (the plan's actual most) is then at most the cap.
    shard_options: this process's share, a `grain.sharding.ShardOptions` (or any object with
      `shard_index`, `shard_count`, `drop_remainder`); None: `jax.process_index()` of
      `jax.process_count()`. `drop_remainder=True` drops an epoch's last `R mod shard_count`
      rows instead of padding.
    loss_mask: apply the source's per-token loss mask (label -100 where the target token has
      mask 0); None: when the source has one (`has_loss_mask`).
    plan_cache_dir: where plans are cached; default `<dataset dir>/plans` for shard sources.
    balance: `segpack.data.balance.BalanceOptions(global_batch_size=..., num_ranks=...)`:
      within every group of `global_batch_size` consecutive epoch rows (one trainer step),
      reorder the rows so that each data-parallel rank's causal attention cost is close to the
      mean (docs/packing.md, "Balancing attention cost over ranks"). The same rows, the same
      count per rank, a deterministic order; None keeps the epoch permutation's order.
    repack: "none" (one plan for every epoch) or "epoch": epoch `e >= 1` gets its own exact
      plan, `segpack.packing.plan(..., tie_seed=(seed, e))` (equal-length chunks in a seeded
      order), so documents meet other neighbours every epoch (docs/packing.md, "A fresh plan
      every epoch"). Its rows have the same lengths as the fixed plan's (epoch 0), so the row
      count, `len()`, `rows_per_epoch` and `max_segments_in_row` do not change. Only for
      `segpack.packing.planner.TIE_SEED_STRATEGIES` ("ffd", "bfd", "sorted_pad") and without
      `max_segments_per_row`; each epoch's plan is computed (not cached) in a background
      thread while the previous epoch is read.
    **deprecated: the previous release's keywords, listed above.

  Returns:
    A `PackedDataset`.

  Raises:
    PipelineConfigError: an argument is invalid, the source is empty, or no document survives.
    TypeError: an unknown keyword.
  """
  fn = "pack_dataset"
  grouped = options.group_deprecated(
      fn, deprecated, special_tokens=special_tokens, long_docs=long_docs,
      shard_options=shard_options, passthrough=("mode",) + options.MINIBATCH_NAMES)
  if grouped.rest:
    minibatches = _deprecated_minibatch_mode(
        source, grouped, seq_len=seq_len, strategy=strategy, seed=seed, shuffle=shuffle,
        num_epochs=num_epochs, loss_mask=loss_mask, max_segments_per_row=max_segments_per_row)
    if minibatches is not None:
      return minibatches
  special_tokens, long_docs = grouped.special_tokens, grouped.long_docs
  options.check_args(fn, seq_len=seq_len, strategy=strategy, seed=seed, num_epochs=num_epochs,
                     special_tokens=special_tokens, long_docs=long_docs)
  options.check_max_segments(fn, max_segments_per_row)
  _check_repack(fn, repack, strategy=strategy, max_segments_per_row=max_segments_per_row)
  index, count, shard_drop = options.resolve_shard(fn, grouped.shard_options)
  if balance is not None:
    if not isinstance(balance, balance_lib.BalanceOptions):
      raise PipelineConfigError(f"{fn}: balance must be a BalanceOptions or None, got {balance!r}")
    balance.check(shard_count=count, fn=fn)
  prepared = sources.prepare(source, fn=fn, special_tokens=special_tokens, loss_mask=loss_mask)
  source, lengths = prepared.source, prepared.lengths
  arrays = _make_plan(lengths, source=source, seq_len=int(seq_len), strategy=strategy,
                      long_docs=long_docs.mode, min_len=int(long_docs.min_len),
                      overlap=int(long_docs.overlap), extra=special_tokens.extra_tokens,
                      max_segments_per_row=max_segments_per_row, plan_cache_dir=plan_cache_dir)
  if arrays.num_rows == 0 or len(arrays.doc) == 0:
    raise PipelineConfigError(
        f"{fn}: no document of the {lengths.size} in the source survives long_docs.min_len="
        f"{long_docs.min_len}; nothing to pack")
  builder = rows_lib.RowBuilder(source, arrays, special=prepared.special, doc_lengths=lengths,
                                loss_mask=prepared.loss_mask)
  dataset = PackedDataset(builder, seed=int(seed), shuffle=bool(shuffle), num_epochs=num_epochs,
                          shard_index=index, shard_count=count, drop_remainder=shard_drop,
                          max_segments_in_row=_max_pieces_per_row(arrays), balance=balance,
                          row_costs=(None if balance is None
                                     else balance_lib.row_attention_cost(arrays)),
                          plan=arrays,
                          epoch_planner=None if repack == "none" else EpochPlanner(
                              lengths=lengths, seed=int(seed), plan_kwargs=dict(
                                  seq_len=int(seq_len), strategy=strategy,
                                  long_docs=long_docs.mode, min_len=int(long_docs.min_len),
                                  overlap=int(long_docs.overlap),
                                  extra_tokens=special_tokens.extra_tokens)))
  if dataset.rows_per_epoch == 0:
    raise PipelineConfigError(
        f"{fn}: the plan has {arrays.num_rows} rows, fewer than shard_count={count} with "
        f"drop_remainder=True: every process would get no rows")
  return dataset


def _check_repack(fn: str, repack: Any, *, strategy: str,
                  max_segments_per_row: int | None) -> None:
  """Refuses a `repack` that is unknown or would change the row count between epochs."""
  if not isinstance(repack, str) or repack not in REPACK_MODES:
    raise PipelineConfigError(f"{fn}: repack must be one of {list(REPACK_MODES)}, got "
                              f"repack={repack!r}")
  if repack == "none":
    return
  allowed = packing.planner.TIE_SEED_STRATEGIES
  if strategy not in allowed:
    raise PipelineConfigError(
        f"{fn}: repack='epoch' needs a strategy whose row count does not depend on the order "
        f"of equal lengths, one of {list(allowed)}; got strategy={strategy!r}")
  if max_segments_per_row is not None:
    raise PipelineConfigError(
        f"{fn}: repack='epoch' is not supported with max_segments_per_row="
        f"{max_segments_per_row!r} (the cap could change the row count between epochs)")


def _deprecated_minibatch_mode(source: Any, grouped: options.Grouped, *, seq_len: Any,
                               strategy: Any, seed: Any, shuffle: Any, num_epochs: Any,
                               loss_mask: Any, max_segments_per_row: Any) -> Any:
  """`pack_dataset(mode=..., examples_per_batch=...)` of the previous release.

  Returns the `pack_minibatches` result for `mode="minibatch"`, None for `mode="global"`
  (whose minibatch keywords are errors, except a `drop_remainder` that never had an effect).
  """
  fn = "pack_dataset"
  rest = dict(grouped.rest)
  mode = rest.pop("mode", "global")
  if mode == "minibatch":
    options.deprecation(
        f"{fn}: mode='minibatch' (with {', '.join(rest) or 'no batch size'}) is deprecated; "
        f"call segpack.pack_minibatches(...), which takes the same keywords", 3)
    if max_segments_per_row is not None:
      raise PipelineConfigError(
          f"{fn}: max_segments_per_row={max_segments_per_row!r} is not supported with "
          f"mode='minibatch'")
    return minibatch_lib.pack_minibatches(
        source, seq_len=seq_len, strategy=strategy, seed=seed, shuffle=shuffle,
        num_epochs=num_epochs, special_tokens=grouped.special_tokens,
        long_docs=grouped.long_docs, shard_options=grouped.shard_options, loss_mask=loss_mask,
        **rest)
  if mode != "global":
    raise PipelineConfigError(f"{fn}: mode must be 'global' or 'minibatch', got {mode!r}")
  for name in ("examples_per_batch", "tokens_per_batch", "rows_per_batch"):
    if rest.get(name) is not None:
      raise PipelineConfigError(
          f"{fn}: {name}={rest[name]!r} is only for minibatch packing; call "
          f"segpack.pack_minibatches(...)")
  options.deprecation(
      f"{fn}: the keyword(s) {', '.join(grouped.rest)} are deprecated and do nothing for rows; "
      f"drop them (minibatch packing is segpack.pack_minibatches)", 3)
  return None

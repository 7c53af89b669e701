"""`pack_dataset`: packed, segment-annotated rows as a Grain `MapDataset`.

The packing plan is computed once per data set (or loaded from the plan cache); the dataset then
maps an index to (epoch, row of that epoch's permutation) and builds the row from memory-mapped
token slices. Everything is a pure function of the index, so Grain's iterator checkpoints
(`get_state` / `set_state`) resume exactly, and `.batch`, `.to_iter_dataset`, `.mp_prefetch`
compose as with any `MapDataset`. The dataset is the whole row stream, the same on every process:
`segpack.data.stream.StreamBatches` cuts it into global batches and gives each process its part.
"""

from __future__ import annotations

import builtins
import os
import sys
from typing import Any, Sequence

import grain
import numpy as np

from segpack import packing
from segpack.data import attention_cost
from segpack.data import batches as batches_lib
from segpack.data import epoch_plans
from segpack.data import mixture as mixture_lib
from segpack.data import options
from segpack.data import rows as rows_lib
from segpack.data import sources
from segpack.data.options import PipelineConfigError, SpecialTokens
from segpack.packing.chunking import LongDocs
from segpack.packing.options import PlanOptions
from segpack.packing.permutation import epoch_permutation

REPACK_MODES = ("none", "epoch")

__all__ = ["LongDocs", "PackedDataset", "PipelineConfigError", "PlanOptions", "REPACK_MODES",
           "SpecialTokens", "pack_dataset"]


class PackedDataset(grain.MapDataset):
  """Packed rows, epoch after epoch, each epoch a seeded permutation of its plan's rows.

  Algorithm for element `i` (`R_e` = `rows_in_epoch(e)`, the rows of epoch `e`'s plan):

  1. Epoch `e` holds elements `[C_e, C_e + R_e)`, `C_e = R_0 + ... + R_{e-1}`; `j = i - C_e`.
     With one plan (or `repack="epoch"`, whose plans have the fixed plan's rows) every `R_e`
     is `R` and this is `divmod(i, R)`; a mixture's epochs each have their own count.
  2. The epoch's row order is a permutation of its `R_e` plan rows drawn from a generator
     seeded by `(seed, epoch)` (plan order without `shuffle`); element `i` is plan row `perm[j]`.
  3. The row is built by `segpack.data.rows.RowBuilder` over the plan of the epoch: the one
     plan, epoch `e`'s own plan with `repack="epoch"`, or the plan of epoch `e`'s draw of a
     mixture (`segpack.data.epoch_plans`).

  Example: R = 5 rows, epoch permutations [3, 0, 4, 1, 2] and [1, 4, 0, 2, 3]: elements 0..4
  are plan rows 3, 0, 4, 1, 2 and element 6 is row 4 of epoch 1.

  `num_epochs=None` makes the dataset infinite (`len == sys.maxsize`, as Grain's `repeat()`);
  otherwise `len` is the rows of the `num_epochs` epochs and indices wrap around modulo it.
  Every process sees the same rows: `segpack.data.stream.StreamBatches` splits global batches
  over processes.
  """

  def __init__(self, builders: epoch_plans.EpochBuilders, *, seed: int, shuffle: bool,
               num_epochs: int | None, segment_bound: int):
    super().__init__()
    self._builders = builders
    self._builder = builders.fixed
    self._seed = seed
    self._shuffle = shuffle
    self._num_epochs = num_epochs
    self._fixed_rows = self._builder.num_rows  # every epoch's rows unless a mixture
    self._segment_bound = int(segment_bound)
    self._costs: dict[int, np.ndarray] = {}
    self._starts = [0]  # C_e of the epochs counted so far (a mixture's, lazily)
    if num_epochs is None:
      self._length = sys.maxsize if self._fixed_rows else 0
    elif builders.same_rows:
      self._length = num_epochs * self._fixed_rows
    else:
      self._length = self.epoch_start(num_epochs)
    self._perms: dict[int, np.ndarray] = {}

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    state["_perms"] = {}
    return state

  @property
  def seq_len(self) -> int:
    return self._builder.seq_len

  @property
  def same_rows(self) -> bool:
    """Whether every epoch has the plan's rows, `rows_in_epoch(0)` (not so for a mixture)."""
    return self._builders.same_rows

  def rows_in_epoch(self, epoch: int) -> int:
    """Rows of epoch `epoch`: the plan's rows, the same for every epoch unless a mixture, whose
    epochs each have their own (plans a mixture's epoch if needed)."""
    return self._builders.rows_in_epoch(int(epoch))

  def epoch_start(self, epoch: int) -> int:
    """`C_e`: the elements before epoch `epoch` (a mixture plans the epochs before it)."""
    if self._builders.same_rows:
      return int(epoch) * self._fixed_rows
    while len(self._starts) <= epoch:
      e = len(self._starts) - 1
      self._starts.append(self._starts[-1] + self.rows_in_epoch(e))
    return self._starts[int(epoch)]

  def locate(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 `(epoch, index in the epoch)` of element indices (after wrapping a finite dataset)."""
    idx = self._wrap(indices)
    if self._builders.same_rows:
      return np.divmod(idx, self._fixed_rows)
    if idx.size:
      while self.epoch_start(len(self._starts) - 1) <= idx.max():
        self.epoch_start(len(self._starts))
    starts = np.asarray(self._starts, dtype=np.int64)
    epoch = np.searchsorted(starts, idx, side="right") - 1
    return epoch, idx - starts[epoch]

  @property
  def num_epochs(self) -> int | None:
    """Epochs (None: infinite)."""
    return self._num_epochs

  @property
  def segment_bound(self) -> int:
    """The most segments in any row (after `max_segments_per_row`; 0 if empty); for a mixture,
    whose later epochs are not planned yet, a bound: the cap, else `seq_len`.

    Rows hold their segments as ids 1..n, so no row this dataset yields has a larger
    `segment_ids.max()`: the static bound a segment-count-shaped kernel needs
    (`segment_attention(cudnn_segment_bound=round_segment_bound(segment_bound))`).
    """
    return self._segment_bound

  def attention_costs(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """int64: `segpack.data.attention_cost.row_attention_cost` of the rows at element `indices`.

    Each epoch's plan costs are computed on first use and kept (8 bytes per plan row; one
    array for all epochs unless a mixture).
    """
    epoch, _ = self.locate(indices)
    rows = self.plan_rows(indices)
    out = np.empty(rows.shape, dtype=np.int64)
    for e in np.unique(epoch).tolist():
      key = 0 if self._builders.same_rows else e
      costs = self._costs.get(key)
      if costs is None:
        costs = attention_cost.row_attention_cost(self._builders.builder(key).plan)
        self._costs = {**dict(list(self._costs.items())[-2:]), key: costs}
      out[epoch == e] = costs[rows[epoch == e]]
    return out

  def padding_rows(self, count: int) -> dict[str, np.ndarray]:
    """`count` all-padding rows (labels -100, segment ids 0), int32 `[count, seq_len]` each."""
    return self._builder.build(np.full(count, rows_lib.PADDING_ROW, dtype=np.int64))

  def __len__(self) -> int:
    return self._length

  def __str__(self) -> str:
    return (f"PackedDataset(seq_len={self.seq_len}, rows_in_epoch(0)={self._fixed_rows}, "
            f"num_epochs={self._num_epochs})")

  def _permutation(self, epoch: int) -> np.ndarray:
    """The row order of `epoch` (the last two epochs' orders are kept)."""
    perm = self._perms.get(epoch)
    if perm is None:
      perm = epoch_permutation(self.rows_in_epoch(epoch), seed=self._seed, epoch=epoch)
      perms = dict(list(self._perms.items())[-1:])  # a new dict: readers in threads keep theirs
      perms[epoch] = perm
      self._perms = perms
    return perm

  def _wrap(self, indices: Any) -> np.ndarray:
    idx = np.asarray(indices, dtype=np.int64)
    if not self._length:
      raise IndexError(f"PackedDataset is empty; index {indices!r} is out of range")
    if self._num_epochs is not None:
      return idx % self._length
    if (idx < 0).any():
      raise IndexError(f"negative index into an infinite PackedDataset: {indices!r}")
    return idx

  def epochs(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """int64: the epoch of each element index (after wrapping a finite dataset)."""
    return self.locate(indices)[0]

  def plan_rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """int64: the plan row of each element index (of its epoch's plan), the shape of `indices`.

    Args:
      indices: element indices (non-negative, or negative from the end of a finite dataset).
    """
    epoch, j = self.locate(indices)
    if not self._shuffle:
      return j
    out = np.empty_like(j)
    for e in np.unique(epoch).tolist():
      sel = epoch == e
      out[sel] = self._permutation(e)[j[sel]]
    return out

  def get_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """Builds the rows of `indices` at once, as int32 `[len(indices), seq_len]` arrays.

    This is the fast path (one vectorized build per epoch the indices touch); `batch()` and
    `StreamBatches` use it.
    """
    rows = self.plan_rows(indices)
    if not self._builders.repacks:
      return self._builder.build(rows)
    epochs = self.epochs(indices)
    parts = {e: self._builders.builder(e).build(rows[epochs == e])
             for e in np.unique(epochs).tolist()}
    if len(parts) == 1:
      return next(iter(parts.values()))
    first = next(iter(parts.values()))
    out = {k: np.empty((len(rows),) + v.shape[1:], v.dtype) for k, v in first.items()}
    for e, features in parts.items():
      for k, v in features.items():
        out[k][epochs == e] = v
    return out

  def __getitem__(self, index):
    if isinstance(index, builtins.slice):
      return self.slice(index)
    with self._stats.record_self_time():
      row = int(self.plan_rows(np.asarray([index]))[0])
      builder = self._builders.builder(int(self.epochs(np.asarray([index]))[0]))
      return self._stats.record_output_spec(builder.build_row(row))

  def _getitems(self, indices: Sequence[int]):
    features = self.get_batch(list(indices))
    return [{k: v[n] for k, v in features.items()} for n in range(len(indices))]

  def batch(self, batch_size: int, *, drop_remainder: bool = False,
            batch_fn=None) -> grain.MapDataset:
    """Like `grain.MapDataset.batch`, with a vectorized path when `batch_fn` is None.

    The result equals `grain.MapDataset.batch` on this dataset (same elements, same grouping;
    each pass over a finite dataset is batched on its own), but every batch is built with one
    vectorized call instead of `batch_size` row builds and a stack.
    """
    if batch_fn is not None:
      return super().batch(batch_size, drop_remainder=drop_remainder, batch_fn=batch_fn)
    return batches_lib.PackedBatchDataset(self, batch_size=batch_size,
                                          drop_remainder=drop_remainder)


def _make_plan(lengths: np.ndarray, *, source: Any, settings: PlanOptions,
               extra_tokens: int, plan_cache_dir: str | os.PathLike | None) -> packing.Plan:
  """The plan of the source's documents, capped at `settings.max_segments_per_row`, from the plan
  cache or computed and cached (`segpack.packing.load_or_plan`).

  The cache is keyed by the source's fingerprint (a hash of the lengths when it has none) and all
  packing parameters; for a shard directory it defaults to `<dataset dir>/plans`.
  """
  fingerprint = getattr(source, "fingerprint", None)
  if plan_cache_dir is None and fingerprint is not None:
    root = getattr(source, "path", None) or getattr(source, "root", None)
    if root is not None:
      plan_cache_dir = os.path.join(os.fspath(root), "plans")
  return settings.load_or_plan(lengths, extra_tokens=extra_tokens, cache_dir=plan_cache_dir,
                               key=None if fingerprint is None else str(fingerprint))


def pack_dataset(
    source: Any,
    *,
    plan: PlanOptions | None = None,
    seq_len: int | None = None,
    strategy: str | None = None,
    long_docs: LongDocs | None = None,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    special_tokens: SpecialTokens = options.DEFAULT_SPECIAL_TOKENS,
    loss_mask: bool | None = None,
    plan_cache_dir: str | os.PathLike | None = None,
    repack: str = "none",
) -> PackedDataset:
  """Packs the documents of `source` into rows: a `PackedDataset` (a `grain.MapDataset`).

  Every element is a dict of int32 `[seq_len]` arrays `input_ids`, `labels`, `segment_ids`,
  `segment_positions` (docs/architecture.md, "Rows"). The packing settings are one
  `segpack.PlanOptions` (`plan=`), or its short spelling, the keywords `seq_len`, `strategy` and
  `long_docs` (`plan=PlanOptions(seq_len=..., strategy=..., long_docs=...)`). The algorithm:

  1. Every document becomes a virtual sequence `[BOS] + tokens + [EOS]` (as `special_tokens`
     says); documents with fewer than `long_docs.min_len` tokens are dropped, and one longer
     than a row is split into chunks of `seq_len` slots, consecutive chunks repeating
     `long_docs.overlap` slots (or, with `long_docs.mode="truncate"`, cut to its first chunk).
  2. `strategy` packs the pieces into rows once for the whole data set: the plan, cached on
     disk (beside the shards for a dataset directory, else in `plan_cache_dir`). With
     `plan.max_segments_per_row`, pieces beyond the cap move to other rows.
     With `repack="epoch"` every later epoch packs them again, equal lengths in a seeded order.
  3. Each epoch is a permutation of the plan's rows seeded by `(seed, epoch)` (plan order
     without `shuffle`), so no row mixes epochs.
  4. The rows are the same on every process: `segpack.data.stream.StreamBatches` cuts them
     into global batches and gives each process its block (and balances them); on one host,
     `.batch(B)` groups consecutive rows.
  5. A row's slots are its pieces' virtual slots, back to back, then padding (`pad_id`):
     `segment_ids` number the pieces 1..n, `segment_positions` count from 0 in each piece, and
     `labels` are the next slot's token within a piece (-100 on a piece's last slot, on
     padding, on repeated overlap slots, and where the source's loss mask is 0).

  Tiny example: seq_len 8, BOS 1, EOS 2, documents [5, 6, 7] and [8] (virtual lengths 5 and 3)
  fill one row: `input_ids = [1 5 6 7 2 1 8 2]`, `segment_ids = [1 1 1 1 1 2 2 2]`,
  `segment_positions = [0 1 2 3 4 0 1 2]`, `labels = [5 6 7 2 -100 8 2 -100]`.

  Args:
    source: a dataset directory, a `segpack.ShardSource`, any random-access sequence of 1-D
      integer arrays (a `grain.MapDataset` included), or a `segpack.Mixture` of sources whose
      weights are shares of trained tokens: every epoch draws its documents and plans them anew
      (`Mixture` documents the draw; `rows_in_epoch(e)` differs between epochs).
    plan: the packing settings, a `segpack.PlanOptions`: `seq_len` (slots per row), `strategy`
      (one of `segpack.packing.STRATEGIES`: "ffd", "bfd", "greedy", "pad", "sorted_pad"),
      `long_docs` (splitting or truncating long documents, chunk overlap, the minimum length),
      `max_segments_per_row` (a cap on segments per row: pieces beyond it go to other rows, and
      the result's `segment_bound`, the plan's actual most, is then at most the cap). None:
      the keywords below spell it.
    seq_len: `PlanOptions.seq_len`, without `plan`.
    strategy: `PlanOptions.strategy`, without `plan` (None: "ffd").
    long_docs: `PlanOptions.long_docs`, without `plan` (None: `LongDocs()`).
    seed: shuffling seed; epoch `e` uses a generator seeded by `(seed, e)`.
    shuffle: shuffle the row order of every epoch (else plan order).
    num_epochs: None for an infinite dataset, else the number of epochs.
    special_tokens: BOS/EOS insertion and the BOS/EOS/padding ids; None ids come from the
      source's tokenizer.
    loss_mask: apply the source's per-token loss mask (label -100 where the target token has
      mask 0); None: when the source has one (`has_loss_mask`).
    plan_cache_dir: where plans are cached; default `<dataset dir>/plans` for shard sources.
    repack: "none" (one plan for every epoch) or "epoch": epoch `e >= 1` gets its own exact
      plan, `segpack.packing.plan(..., tie_seed=(seed, e))` (equal-length chunks in a seeded
      order), so documents meet other neighbours every epoch (docs/packing.md, "A fresh plan
      every epoch"). Its rows have the same lengths as the fixed plan's (epoch 0), so the row
      count (`rows_in_epoch(e)`), `len()` and `segment_bound` do not change. Only for
      `segpack.packing.planner.TIE_SEED_STRATEGIES` ("ffd", "bfd", "sorted_pad") and without
      `max_segments_per_row`; each epoch's plan is computed (not cached) in a background
      thread while the previous epoch is read.

  Returns:
    A `PackedDataset`.

  Raises:
    PipelineConfigError: an argument is invalid (`plan` and the keywords together included), the
      source is empty, or no document survives.
  """
  fn = "pack_dataset"
  plan = options.plan_options(fn, plan, seq_len=seq_len, strategy=strategy, long_docs=long_docs)
  options.check_args(fn, plan=plan, seed=seed, num_epochs=num_epochs,
                     special_tokens=special_tokens)
  cap = plan.max_segments_per_row
  if isinstance(source, mixture_lib.Mixture):
    if repack != "none":
      raise PipelineConfigError(
          f"{fn}: repack={repack!r} with a Mixture: a mixture draws and plans every epoch anew "
          f"already; pass repack='none'")
    draws = mixture_lib.MixtureDraws(source, seed=int(seed), fn=fn)
    prepared = sources.prepare(draws.draw(0).documents, fn=fn, special_tokens=special_tokens,
                               loss_mask=loss_mask)
    planner = epoch_plans.MixturePlanner(draws=draws, options=plan, special=prepared.special,
                                         loss_mask=prepared.loss_mask)
    builder = planner.builder(0)
    bound = int(plan.seq_len) if cap is None else int(cap)
  else:
    _check_repack(fn, repack, strategy=plan.strategy, max_segments_per_row=cap)
    prepared = sources.prepare(source, fn=fn, special_tokens=special_tokens, loss_mask=loss_mask)
    extra = prepared.special.extra_tokens
    fixed = _make_plan(prepared.lengths, source=prepared.source, settings=plan,
                       extra_tokens=extra, plan_cache_dir=plan_cache_dir)
    builder = rows_lib.RowBuilder(prepared.source, fixed, special=prepared.special,
                                  doc_lengths=prepared.lengths, loss_mask=prepared.loss_mask)
    planner = (None if repack == "none" else plan.repack_planner(
        prepared.lengths, extra_tokens=extra, seed=int(seed)))
    bound = int(np.diff(np.asarray(fixed.row_splits, dtype=np.int64)).max(initial=0))
  if builder.num_rows == 0 or len(builder.plan.doc) == 0:
    raise PipelineConfigError(
        f"{fn}: no document of the {prepared.lengths.size} in the source survives "
        f"long_docs.min_len={plan.long_docs.min_len}; nothing to pack")
  builders = epoch_plans.EpochBuilders(builder, planner=planner, num_epochs=num_epochs)
  return PackedDataset(builders, seed=int(seed), shuffle=bool(shuffle), num_epochs=num_epochs,
                       segment_bound=bound)


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



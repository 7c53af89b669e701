"""`plan()`: chunk the documents, run a packer, and lay the pieces out row by row.

Words: a *packer* is the algorithm of a strategy (chunk lengths -> a `Placement`); a *plan* is the
rows it gives, with their pieces (`Plan`); a *planner* gives the plan of each epoch (`plan(epoch)`:
`RepackPlanner` here, `MinibatchPlanner` for minibatches, `segpack.data.epoch_plans` for mixtures).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable

import numpy as np

from segpack.packing import layout
from segpack.packing.bfd import BestFitDecreasing, best_fit_decreasing
from segpack.packing.chunking import (DEFAULT_LONG_DOCS, Chunks, LongDocs, PackingArgumentError,
                                      check_lengths, index_dtype, make_chunks)
from segpack.packing.ffd import ONE_BY_ONE, FirstFitDecreasing, first_fit_decreasing
from segpack.packing.greedy import next_fit
from segpack.packing.padded import one_per_row, sorted_one_per_row, sorted_pad_slots
from segpack.packing.plan_format import Plan
from segpack.packing.runs import Placement

# A packer maps (chunk lengths, seq_len) to a Placement (see segpack.packing.runs).
Packer = Callable[[np.ndarray, int], Placement]

# The packers whose rows depend only on the sorted chunk lengths (longest first): any order of
# equal lengths gives rows of the same lengths, so `tie_seed` only changes which chunks meet.
TIE_SEED_STRATEGIES = ("ffd", "bfd", "sorted_pad")

# The run packers of the strategies `layout` plans (FFD above `ONE_BY_ONE`
# chunks; below, its one-by-one path is faster).
_RUN_PACKERS = {
    "ffd": lambda seq_len, bins: FirstFitDecreasing(seq_len, bins_bound=bins),
    "bfd": lambda seq_len, bins: BestFitDecreasing(seq_len),
}

STRATEGIES: dict[str, Packer] = {
    "ffd": first_fit_decreasing,
    "bfd": best_fit_decreasing,
    "greedy": next_fit,
    "pad": one_per_row,
    "sorted_pad": sorted_one_per_row,
}


def check_strategy(strategy: Any) -> Packer:
  """The packer named `strategy`, or an error that lists the valid names."""
  if not isinstance(strategy, str) or strategy not in STRATEGIES:
    raise PackingArgumentError(
        f"strategy must be one of {sorted(STRATEGIES)}, got strategy={strategy!r}")
  return STRATEGIES[strategy]


def plan(lengths: Any, seq_len: int, *, strategy: str = "ffd",
         long_docs: LongDocs = DEFAULT_LONG_DOCS, extra_tokens: int = 0, batch_size: int = 8,
         pad_multiple: int = 128, tie_seed: Any = None) -> Plan:
  """Plans how the documents fill rows of `seq_len` slots.

  Document `d` is a virtual sequence of `lengths[d] + extra_tokens` slots (the pipeline passes
  `extra_tokens = add_bos + add_eos`; slot 0 is then BOS and the last slot EOS). Documents with
  `lengths[d] < long_docs.min_len` (or no slot) are dropped; longer ones than `seq_len` are split
  into chunks overlapping by `long_docs.overlap` slots (mode "split") or cut to their first
  `seq_len` slots ("truncate"); see `segpack.packing.chunking.make_chunks`. The chunks are then
  packed:

  - `ffd`: exact first-fit-decreasing over the whole data set (the default);
  - `bfd`: exact best-fit-decreasing;
  - `greedy`: next fit in document order, as t5x/seqio's `pack`;
  - `pad`: one chunk per row, in document order;
  - `sorted_pad`: one chunk per row, longest first; its `stats["slots"]` counts batches of
    `batch_size` rows padded to their longest row rounded up to `pad_multiple`.

  Args:
    lengths: 1-D integer array of document lengths (tokens, without BOS/EOS).
    seq_len: slots per row.
    strategy: one of `STRATEGIES`.
    long_docs: `LongDocs(mode, overlap, min_len)`: "split" or "truncate"; the slots a
      continuation chunk repeats from the previous chunk (`0 <= overlap < seq_len`; the pipeline
      trains no loss on them); documents with fewer than `min_len` tokens are dropped.
    extra_tokens: virtual slots added to every document.
    batch_size: rows per batch, for `sorted_pad`'s slot count only.
    pad_multiple: batch length granularity, for `sorted_pad`'s slot count only.
    tie_seed: None (ties of equal length in chunk order), or an int or a sequence of ints
      (e.g. `(seed, epoch)`): the chunks reach the packer in the order of a permutation drawn
      from `default_rng(SeedSequence(tie_seed))`, so the stable longest-first sort orders equal
      lengths by it. Only for `TIE_SEED_STRATEGIES`: their rows then hold the same lengths in
      the same row order (the same row count, utilization and per-row segment counts), filled
      by other chunks of those lengths.

  Returns:
    The `Plan`, rows in the packer's order, pieces inside a row in placement order.

  Raises:
    PackingArgumentError: an argument is invalid; the message names it and its value.
  """
  packer = check_strategy(strategy)
  chunks = _checked_chunks(lengths, seq_len, long_docs=long_docs, extra_tokens=extra_tokens,
                           batch_size=batch_size, pad_multiple=pad_multiple)
  num_docs = chunks.stats["documents"]
  rng = _tie_rng(tie_seed, strategy)
  if _runs_apply(strategy, chunks):
    rows = layout.place_rows(chunks, seq_len, functools.partial(_RUN_PACKERS[strategy], seq_len))
    doc, start, length = layout.lay_out(chunks, rows, seq_len=seq_len, num_docs=num_docs,
                                        rng=rng, consume=True)
    row_splits, max_per_row = rows.row_splits, rows.max_per_row
  else:
    row_splits, doc, start, length, max_per_row = _plan_placement(
        packer, chunks, seq_len, rng=rng, num_docs=num_docs)
  return _finish(chunks.stats, seq_len, row_splits, doc, start, length, max_per_row,
                 strategy=strategy, overlap=long_docs.overlap, extra_tokens=extra_tokens,
                 batch_size=batch_size, pad_multiple=pad_multiple)


class RepackPlanner:
  """The plan of every epoch with `repack="epoch"`: `plan(epoch)` is `plan(lengths, seq_len,
  tie_seed=(seed, epoch), **kwargs)`, sharing the work that does not depend on the epoch.

  FFD's and BFD's rows depend only on the sorted chunk lengths, so the rows
  (`layout.place_rows`) and the documents sorted longest first (ties by index) are computed on
  the first call and kept; every call then only shuffles each run of equal lengths by
  `(seed, epoch)` and writes the documents into the rows. It keeps about 7 bytes per document
  between calls (the sorted documents, the runs and `row_splits`, which the plans share,
  read-only). Other strategies, and inputs small enough for FFD's one-by-one path, call `plan`
  every time. `plan(epoch)` is a pure function of `(seed, epoch)` and may be called from several
  threads at once.
  """

  def __init__(self, lengths: Any, seq_len: int, *, seed: int, strategy: str = "ffd",
               long_docs: LongDocs = DEFAULT_LONG_DOCS, extra_tokens: int = 0,
               batch_size: int = 8, pad_multiple: int = 128):
    check_strategy(strategy)
    _tie_rng(0, strategy)  # a strategy without tie seeds is refused here, not at every epoch
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
      raise PackingArgumentError(f"seed must be an int >= 0, got seed={seed!r}")
    self._lengths = lengths
    self._seq_len = seq_len
    self._seed = int(seed)
    self._kwargs = dict(strategy=strategy, long_docs=long_docs, extra_tokens=extra_tokens,
                        batch_size=batch_size, pad_multiple=pad_multiple)
    self._state: tuple[Chunks, layout.Rows | None, tuple | None] | None = None
    self._lock = threading.Lock()

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    state["_state"] = None  # recomputed where it is needed
    del state["_lock"]
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def plan(self, epoch: int) -> Plan:
    """The plan of `epoch`: `plan(..., tie_seed=(seed, epoch))`."""
    kw = self._kwargs
    strategy, seq_len = kw["strategy"], self._seq_len
    tie_seed = (self._seed, int(epoch))
    rng = _tie_rng(tie_seed, strategy)
    with self._lock:
      if self._state is None:
        chunks = _checked_chunks(self._lengths, seq_len, **{k: v for k, v in kw.items()
                                                            if k != "strategy"})
        rows = presorted = None
        if _runs_apply(strategy, chunks):
          rows = layout.place_rows(chunks, seq_len,
                                   functools.partial(_RUN_PACKERS[strategy], seq_len))
          docs = np.empty(len(chunks.length), index_dtype(chunks.stats["documents"]))
          presorted = layout.sorted_documents(chunks, rows.hist, out=docs, rng=None)
          docs.flags.writeable = False
          chunks.length = chunks.kept = None  # the sorted documents hold what is needed
        self._state = (chunks, rows, presorted)
      chunks, rows, presorted = self._state
    if rows is None:
      return plan(self._lengths, seq_len, tie_seed=tie_seed, **kw)
    num_docs = chunks.stats["documents"]
    doc, start, length = layout.lay_out(chunks, rows, seq_len=seq_len, num_docs=num_docs,
                                        rng=rng, consume=False, presorted=presorted)
    return _finish(chunks.stats, seq_len, rows.row_splits, doc, start, length, rows.max_per_row,
                   overlap=kw["long_docs"].overlap,
                   **{k: v for k, v in kw.items() if k != "long_docs"})


def _checked_chunks(lengths: Any, seq_len: int, *, long_docs: LongDocs, extra_tokens: int,
                    batch_size: int, pad_multiple: int) -> Chunks:
  """Validates the arguments and cuts the documents into chunks (at least one)."""
  lengths = check_lengths(lengths)
  for name, value in (("batch_size", batch_size), ("pad_multiple", pad_multiple)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise PackingArgumentError(f"{name} must be an int >= 1, got {name}={value!r}")
  chunks = make_chunks(lengths, seq_len, long_docs=long_docs, extra_tokens=extra_tokens)
  if len(chunks.length) == 0:
    raise PackingArgumentError(
        f"no document is left to pack: all {len(lengths)} are shorter than "
        f"long_docs.min_len={long_docs.min_len} or empty")
  return chunks


def _runs_apply(strategy: str, chunks: Chunks) -> bool:
  """Whether `layout` plans these chunks (FFD above `ONE_BY_ONE` chunks, BFD always)."""
  return strategy in _RUN_PACKERS and (strategy == "bfd" or len(chunks.length) > ONE_BY_ONE)


def _finish(chunk_stats: dict[str, Any], seq_len: int, row_splits: np.ndarray, doc: np.ndarray,
            start: np.ndarray, length: np.ndarray, max_per_row: int, *, strategy: str,
            overlap: int, extra_tokens: int, batch_size: int, pad_multiple: int) -> Plan:
  """The `Plan` of these arrays, with its statistics."""
  stats = dict(chunk_stats)
  tokens = stats["tokens"]
  num_rows = len(row_splits) - 1
  if strategy == "sorted_pad":
    slots = sorted_pad_slots(length.astype(np.int64), batch_size=batch_size,
                             pad_multiple=pad_multiple, seq_len=seq_len)
    stats.update(batch_size=int(batch_size), pad_multiple=int(pad_multiple))
  else:
    slots = num_rows * seq_len
  stats.update(rows=num_rows, slots=slots, lower_bound=-(-tokens // seq_len),
               utilization=tokens / slots, segments_per_row_mean=len(doc) / num_rows,
               segments_per_row_max=max_per_row)
  return Plan(seq_len=int(seq_len), overlap=int(overlap), extra_tokens=int(extra_tokens),
              strategy=strategy, row_splits=row_splits, doc=doc, start=start, length=length,
              stats=stats)


def _plan_placement(packer: Packer, chunks: Chunks, seq_len: int, *,
                    rng: np.random.Generator | None, num_docs: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
  """`(row_splits, doc, start, length, max_per_row)` through a `Placement` packer (the strategies
  and inputs `layout` does not take)."""
  placement = _place(packer, chunks.length, seq_len, rng=rng)
  per_row = np.bincount(placement.bins)
  row_splits = np.zeros(len(per_row) + 1, np.int64)
  np.cumsum(per_row, out=row_splits[1:])
  perm = _row_major(placement, row_splits)
  doc = (perm if chunks.doc is None else chunks.doc[perm]).astype(index_dtype(num_docs))
  start = chunks.start
  start = np.zeros(len(perm), np.int32) if start is None else start[perm]
  return row_splits, doc, start, chunks.length[perm], int(per_row.max())


def _tie_rng(tie_seed: Any, strategy: str) -> np.random.Generator | None:
  """The generator that orders equal lengths for `tie_seed` (None: ties by index)."""
  if tie_seed is None:
    return None
  if strategy not in TIE_SEED_STRATEGIES:
    raise PackingArgumentError(
        f"tie_seed is only for strategies {list(TIE_SEED_STRATEGIES)} (their row count does "
        f"not depend on the order of equal lengths), got strategy={strategy!r}")
  try:
    entropy = [int(tie_seed)] if np.ndim(tie_seed) == 0 else [int(v) for v in tie_seed]
    return np.random.default_rng(np.random.SeedSequence(entropy))
  except (TypeError, ValueError) as e:
    raise PackingArgumentError(
        f"tie_seed must be None, a non-negative int or a sequence of them, got "
        f"tie_seed={tie_seed!r}") from e


def _place(packer: Packer, length: np.ndarray, seq_len: int, *,
           rng: np.random.Generator | None) -> Placement:
  """`packer(length, seq_len)`, the chunks first permuted by `rng` when it is given."""
  if rng is None:
    return packer(length, seq_len)
  perm = rng.permutation(len(length))
  placement = packer(length[perm], seq_len)
  return dataclasses.replace(placement, order=perm[placement.order])


def _row_major(placement: Placement, row_splits: np.ndarray) -> np.ndarray:
  """Chunk indices row by row: a counting sort by (bin, rank)."""
  if placement.rank is None:
    return placement.order
  pos = row_splits[placement.bins]
  pos += placement.rank
  perm = np.empty(len(pos), np.int64)
  perm[pos] = placement.order
  return perm

"""Row construction: turns plan rows into the four int32 row features.

A plan row is a list of pieces `(doc, start, length)` over *virtual sequences* (see
docs/architecture.md, "Packing plan"): virtual slot 0 of document `d` is BOS (with `add_bos`), the
last virtual slot is EOS (with `add_eos`), the slots between are the document's tokens. This module
reads the tokens of those pieces (memory-mapped slices, never whole files) and builds `input_ids`,
`labels`, `segment_ids` and `segment_positions` for many rows at once with vectorized NumPy.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import mmap
import os
from typing import Any, Sequence

import numpy as np

IGNORE_LABEL = -100
FEATURES = ("input_ids", "labels", "segment_ids", "segment_positions")
PADDING_ROW = -1


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """Token ids the row builder inserts.

  Attributes:
    add_bos: whether virtual slot 0 of every document is `bos_id`.
    add_eos: whether the last virtual slot of every document is `eos_id`.
    bos_id: BOS token id (ignored unless `add_bos`).
    eos_id: EOS token id (ignored unless `add_eos`).
    pad_id: `input_ids` value on padding slots.
  """

  add_bos: bool
  add_eos: bool
  bos_id: int = -1
  eos_id: int = -1
  pad_id: int = 0


@dataclasses.dataclass(frozen=True)
class PlanArrays:
  """The plan arrays the row builder reads (a subset of `segpack.packing.Plan`).

  Attributes:
    seq_len: slots per row.
    overlap: repeated leading slots of a continuation chunk (they carry no loss as targets).
    row_splits: int64 `[num_rows + 1]`; row `r` holds pieces `row_splits[r]:row_splits[r+1]`.
    doc: int64 `[num_pieces]` document index of each piece.
    start: int32 `[num_pieces]` first virtual slot of each piece.
    length: int32 `[num_pieces]` slots of each piece.
  """

  seq_len: int
  overlap: int
  row_splits: np.ndarray
  doc: np.ndarray
  start: np.ndarray
  length: np.ndarray

  @property
  def num_rows(self) -> int:
    return int(self.row_splits.shape[0]) - 1

  def __reduce__(self):
    # Memory-mapped arrays (a cached plan) travel to Grain workers as file references.
    arrays = [_pickle_array(getattr(self, f)) for f in ("row_splits", "doc", "start", "length")]
    return _restore_plan_arrays, (self.seq_len, self.overlap, *arrays)


def _pickle_array(array: np.ndarray) -> Any:
  if (isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap) and array.filename
      and array.flags.c_contiguous):
    return ("memmap", array.filename, array.dtype.str, array.shape, array.offset)
  return np.asarray(array)


def _unpickle_array(value: Any) -> np.ndarray:
  if isinstance(value, tuple) and value[0] == "memmap":
    _, filename, dtype, shape, offset = value
    if not int(np.prod(shape)):
      return np.zeros(shape, dtype=dtype)
    return np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=shape)
  return value


def _restore_plan_arrays(seq_len, overlap, row_splits, doc, start, length) -> "PlanArrays":
  return PlanArrays(seq_len=seq_len, overlap=overlap, row_splits=_unpickle_array(row_splits),
                    doc=_unpickle_array(doc), start=_unpickle_array(start),
                    length=_unpickle_array(length))


class SequenceSliceReader:
  """Reads document slices through a per-document getter: `source[d]` for tokens, or
  `source.loss_mask(d)` for per-token loss masks (any random-access source)."""

  def __init__(self, fetch: Any):
    self._fetch = fetch

  def copy(self, out: np.ndarray, doc_P: np.ndarray, lo_P: np.ndarray, hi_P: np.ndarray,
           dst_P: np.ndarray) -> None:
    """Copies `fetch(doc)[lo:hi]` to `out[dst:]` for every piece."""
    fetch = self._fetch
    for d, lo, hi, dst in zip(doc_P.tolist(), lo_P.tolist(), hi_P.tolist(), dst_P.tolist()):
      if hi > lo:
        out[dst:dst + hi - lo] = np.asarray(fetch(d))[lo:hi]


class ShardTokenReader:
  """Reads document slices straight from the token files of a `segpack.ShardSource`.

  With `kind="mask"` it reads the shards' loss-mask files (uint8, aligned with the tokens)
  instead.

  Algorithm:
    1. From the manifest (shard token file names, documents per shard) and `source.lengths`,
       compute each document's first token inside its shard file: the exclusive cumulative sum
       of the lengths, restarted at every shard (exactly the shard's offsets file, which
       `ShardSource` checked on open). 4 bytes per document (8 when a shard exceeds 2**31 tokens).
    2. Open each token file once per process as a read-only memory map, viewed as a plain ndarray
       (slicing a plain view is ~10x cheaper than slicing `np.memmap` objects); nothing is read
       until a slice is copied.
    3. For a batch of pieces, find the shards with one `searchsorted`, then copy each piece's
       slice into the output.

  Example: shards of 2 and 1 documents with lengths [3, 2, 4] give starts [0, 3, 0]; document 2,
  tokens [1, 3) is shard 1's file slice [1, 3).
  """

  def __init__(self, source: Any, *, kind: str = "tokens"):
    shards = source.manifest["shards"]
    self._path = os.fspath(source.path)
    self._files = [str(shard[kind]) for shard in shards]
    self._dtype = np.dtype(np.uint8) if kind == "mask" else np.dtype(source.dtype)
    counts = np.asarray([int(shard["num_documents"]) for shard in shards], dtype=np.int64)
    self._doc_starts = np.zeros(len(shards) + 1, dtype=np.int64)
    np.cumsum(counts, out=self._doc_starts[1:])
    lengths = np.asarray(source.lengths, dtype=np.int64)
    if lengths.shape[0] != self._doc_starts[-1]:
      raise ValueError(f"{self._path}: manifest lists {self._doc_starts[-1]} documents but the "
                       f"source has {lengths.shape[0]} lengths")
    token_start = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=token_start[1:])
    local = token_start[:-1] - np.repeat(token_start[self._doc_starts[:-1]], counts)
    small = local.size == 0 or int(local.max()) < 2**31
    self._local_start = local.astype(np.int32 if small else np.int64)
    self._arrays: list[np.ndarray] | None = None

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    state["_arrays"] = None  # Reopened lazily in every process.
    return state

  def _open(self) -> list[np.ndarray]:
    if self._arrays is None:
      arrays = []
      for name in self._files:
        file = os.path.join(self._path, name)
        if os.path.getsize(file) == 0:
          arrays.append(np.zeros(0, dtype=self._dtype))
        else:
          arrays.append(np.asarray(np.memmap(file, dtype=self._dtype, mode="r")))
      self._arrays = arrays
    return self._arrays

  def copy(self, out: np.ndarray, doc_P: np.ndarray, lo_P: np.ndarray, hi_P: np.ndarray,
           dst_P: np.ndarray) -> None:
    """Copies tokens `[lo, hi)` of every piece's document to `out[dst:]`."""
    arrays = self._open()
    shard_P = np.searchsorted(self._doc_starts, doc_P, side="right") - 1
    base_P = self._local_start[doc_P].astype(np.int64)
    for s, a, b, dst in zip(shard_P.tolist(), (base_P + lo_P).tolist(), (base_P + hi_P).tolist(),
                            dst_P.tolist()):
      if b > a:
        out[dst:dst + b - a] = arrays[s][a:b]


def make_token_reader(source: Any) -> SequenceSliceReader | ShardTokenReader:
  """A `ShardTokenReader` for a shard source (has `path`, `manifest`, `dtype`, `lengths`), else a
  `SequenceSliceReader`."""
  manifest = getattr(source, "manifest", None)
  if (isinstance(manifest, dict) and isinstance(manifest.get("shards"), list)
      and hasattr(source, "path") and hasattr(source, "dtype") and hasattr(source, "lengths")):
    try:
      return ShardTokenReader(source)
    except (KeyError, TypeError):
      pass
  return SequenceSliceReader(source.__getitem__)


def make_mask_reader(source: Any) -> SequenceSliceReader | ShardTokenReader:
  """The loss-mask counterpart of `make_token_reader` (the source must have `loss_mask(d)`)."""
  manifest = getattr(source, "manifest", None)
  if (isinstance(manifest, dict) and manifest.get("loss_mask") is True
      and hasattr(source, "path") and hasattr(source, "lengths")):
    try:
      return ShardTokenReader(source, kind="mask")
    except (KeyError, TypeError):
      pass
  return SequenceSliceReader(source.loss_mask)


class RowBuilder:
  """Builds packed rows (dicts of int32 arrays) from plan rows and a token source.

  Algorithm, for a batch of plan row indices (index `-1` is an all-padding row):

  1. Gather the pieces of the requested rows: piece ranges `row_splits[r]:row_splits[r+1]` are
     concatenated with one `np.repeat`/`arange` trick (no loop over rows).
  2. Give every piece its flat output offset: `row * seq_len + (cumulative length of the earlier
     pieces of its row)`, and its segment id: 1 + (rank of the piece within its row).
  3. Copy tokens: one slice copy per piece from the memory-mapped token file (a
     `ShardTokenReader`, or `source[doc]` for other sources), plus the BOS/EOS slots where the
     piece covers virtual slot 0 / the last virtual slot.
  4. The real slots of a row are a prefix of it: `segment_ids` and `segment_positions` of all
     real slots are built contiguously (`np.repeat` of the per-piece segment id; `arange` minus
     the repeated piece offsets), then copied into each row's prefix.
  5. `labels` = `input_ids` shifted left by one, then -100 at every piece's last slot, on
     padding, and on targets that are repeated overlap slots of a continuation chunk.
  6. With a loss mask (`loss_mask=True`): the mask slices are copied like the tokens (the EOS
     slot takes the mask of the document's last token, the BOS slot 0), and every label whose
     target slot has mask 0 becomes -100.

  `build_row` does the same for a single row with a loop over its few pieces.

  Tiny example (seq_len 10, add_bos and add_eos, bos 1, eos 2, document 0 = [5, 6], document 1 =
  [7, 8], so both virtual sequences have 4 slots): the row with pieces (0, 0, 4) and (1, 0, 4) is
  `input_ids = [1 5 6 2 1 7 8 2 0 0]`, `segment_ids = [1 1 1 1 2 2 2 2 0 0]`,
  `segment_positions = [0 1 2 3 0 1 2 3 0 0]`,
  `labels = [5 6 2 -100 7 8 2 -100 -100 -100]`.
  """

  def __init__(self, source: Any, plan: PlanArrays, *, special: SpecialTokens,
               doc_lengths: np.ndarray, loss_mask: bool = False):
    """Creates the builder.

    Args:
      source: random-access sequence of 1-D integer arrays (`source[d]` = tokens of document d).
      plan: the plan arrays.
      special: BOS/EOS/padding ids.
      doc_lengths: int64 `[num_docs]` token counts of the source documents.
      loss_mask: apply the source's per-token loss mask (`source.loss_mask(d)`, 1 = trained) to
        the labels.
    """
    self._reader = make_token_reader(source)
    self._mask_reader = make_mask_reader(source) if loss_mask else None
    self._plan = plan
    self._special = special
    self._doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    self._views: PlanArrays | None = None

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    state["_views"] = None  # The plan pickles as file references when memory-mapped.
    return state

  def _plan_views(self) -> PlanArrays:
    """The plan with plain ndarray views of its arrays (indexing `np.memmap` objects is slow)."""
    if self._views is None:
      p = self._plan
      self._views = PlanArrays(seq_len=p.seq_len, overlap=p.overlap,
                               row_splits=np.asarray(p.row_splits), doc=np.asarray(p.doc),
                               start=np.asarray(p.start), length=np.asarray(p.length))
    return self._views

  @property
  def seq_len(self) -> int:
    return self._plan.seq_len

  @property
  def num_rows(self) -> int:
    return self._plan.num_rows

  def with_plan(self, plan: PlanArrays) -> "RowBuilder":
    """A builder of the same source, special tokens and readers over another plan."""
    other = copy.copy(self)
    other._plan = plan  # pylint: disable=protected-access
    other._views = None  # pylint: disable=protected-access
    return other

  def build(self, rows: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """Returns the features of `rows` as int32 `[len(rows), seq_len]` arrays.

    Args:
      rows: plan row indices in `[0, num_rows)`, or -1 for an all-padding row.
    """
    plan, seq_len = self._plan_views(), self._plan.seq_len
    rows_B = np.asarray(rows, dtype=np.int64).reshape(-1)
    batch = rows_B.shape[0]
    real_B = rows_B >= 0
    safe_B = np.where(real_B, rows_B, 0)
    lo_B = np.where(real_B, plan.row_splits[safe_B], 0).astype(np.int64)
    count_B = np.where(real_B, plan.row_splits[safe_B + 1] - lo_B, 0).astype(np.int64)
    num_pieces = int(count_B.sum())
    first_B = np.cumsum(count_B) - count_B  # index of each row's first piece among the gathered
    rank_P = np.arange(num_pieces, dtype=np.int64) - np.repeat(first_B, count_B)
    piece_P = np.repeat(lo_B, count_B) + rank_P
    doc_P = np.asarray(plan.doc[piece_P], dtype=np.int64)
    start_P = np.asarray(plan.start[piece_P], dtype=np.int64)
    length_P = np.asarray(plan.length[piece_P], dtype=np.int64)
    cum_P = np.zeros(num_pieces + 1, dtype=np.int64)
    np.cumsum(length_P, out=cum_P[1:])
    used_B = cum_P[first_B + count_B] - cum_P[first_B]  # occupied slots of each row
    col_P = cum_P[:-1] - np.repeat(cum_P[first_B], count_B)  # piece offset inside its row
    offset_P = np.repeat(np.arange(batch, dtype=np.int64) * seq_len, count_B) + col_P

    input_ids = np.full(batch * seq_len, self._special.pad_id, dtype=np.int32)
    self._copy_tokens(input_ids, doc_P, start_P, length_P, offset_P)
    # Real slots fill a prefix of every row: build them contiguously, then copy row prefixes.
    num_real = int(cum_P[-1])
    segment_real = np.repeat((rank_P + 1).astype(np.int32), length_P)
    position_real = np.arange(num_real, dtype=np.int32)
    position_real -= np.repeat(cum_P[:-1].astype(np.int32), length_P)
    segment_ids_BxS = np.zeros((batch, seq_len), dtype=np.int32)
    positions_BxS = np.zeros((batch, seq_len), dtype=np.int32)
    src_B = cum_P[first_B].tolist()
    for b, (a, n) in enumerate(zip(src_B, used_B.tolist())):
      segment_ids_BxS[b, :n] = segment_real[a:a + n]
      positions_BxS[b, :n] = position_real[a:a + n]
    input_ids_BxS = input_ids.reshape(batch, seq_len)
    # Labels: the next slot's token, then -100 at every piece's last slot and on padding.
    labels_BxS = np.empty((batch, seq_len), dtype=np.int32)
    labels_BxS[:, :-1] = input_ids_BxS[:, 1:]
    labels_BxS[:, -1] = IGNORE_LABEL
    labels_BxS.reshape(-1)[offset_P + length_P - 1] = IGNORE_LABEL
    for b, n in enumerate(used_B.tolist()):
      labels_BxS[b, n:] = IGNORE_LABEL
    self._mask_overlap(labels_BxS.reshape(-1), start_P, length_P, offset_P)
    if self._mask_reader is not None:
      trained = np.zeros(batch * seq_len, dtype=np.uint8)
      self._copy_mask(trained, doc_P, start_P, length_P, offset_P)
      trained_BxS = trained.reshape(batch, seq_len)
      labels_BxS[:, :-1][trained_BxS[:, 1:] == 0] = IGNORE_LABEL
    return {
        "input_ids": input_ids_BxS,
        "labels": labels_BxS,
        "segment_ids": segment_ids_BxS,
        "segment_positions": positions_BxS,
    }

  def build_row(self, row: int) -> dict[str, np.ndarray]:
    """The features of one plan row (-1: an all-padding row) as int32 `[seq_len]` arrays.

    Equal to `build([row])` (the tests check it), but with a short loop over the row's pieces
    instead of batch-wide gathers, which is faster for one row.
    """
    plan, seq_len, special = self._plan_views(), self._plan.seq_len, self._special
    input_ids = np.full(seq_len, special.pad_id, dtype=np.int32)
    labels = np.full(seq_len, IGNORE_LABEL, dtype=np.int32)
    segment_ids = np.zeros(seq_len, dtype=np.int32)
    positions = np.zeros(seq_len, dtype=np.int32)
    if row >= 0:
      a, b = int(plan.row_splits[row]), int(plan.row_splits[row + 1])
      doc_P = plan.doc[a:b].astype(np.int64)
      start_P = plan.start[a:b].astype(np.int64)
      length_P = plan.length[a:b].astype(np.int64)
      offset_P = np.cumsum(length_P) - length_P
      self._copy_tokens(input_ids, doc_P, start_P, length_P, offset_P)
      ramp = np.arange(seq_len, dtype=np.int32)
      for k, (n, o) in enumerate(zip(length_P.tolist(), offset_P.tolist())):
        segment_ids[o:o + n] = k + 1
        positions[o:o + n] = ramp[:n]
        labels[o:o + n - 1] = input_ids[o + 1:o + n]
      self._mask_overlap(labels, start_P, length_P, offset_P)
      if self._mask_reader is not None:
        trained = np.zeros(seq_len, dtype=np.uint8)
        self._copy_mask(trained, doc_P, start_P, length_P, offset_P)
        labels[:-1][trained[1:] == 0] = IGNORE_LABEL
    return {"input_ids": input_ids, "labels": labels, "segment_ids": segment_ids,
            "segment_positions": positions}

  def _copy_tokens(self, out: np.ndarray, doc_P: np.ndarray, start_P: np.ndarray,
                   length_P: np.ndarray, offset_P: np.ndarray) -> None:
    """Writes each piece's slots (BOS, a slice of the document, EOS) into `out` at its offset."""
    special = self._special
    bos = int(special.add_bos)
    doc_len_P = self._doc_lengths[doc_P]
    token_lo_P = np.maximum(start_P - bos, 0)
    token_hi_P = np.minimum(start_P + length_P - bos, doc_len_P)
    dst_P = offset_P + (start_P < bos)  # a BOS slot comes first
    self._reader.copy(out, doc_P, token_lo_P, token_hi_P, dst_P)
    if special.add_bos:
      out[offset_P[start_P == 0]] = special.bos_id
    if special.add_eos:
      ends_eos = start_P + length_P == doc_len_P + bos + 1
      out[(offset_P + length_P - 1)[ends_eos]] = special.eos_id

  def _copy_mask(self, out: np.ndarray, doc_P: np.ndarray, start_P: np.ndarray,
                 length_P: np.ndarray, offset_P: np.ndarray) -> None:
    """Writes each piece's loss mask (BOS slot 0, the tokens' mask, EOS slot = the mask of the
    document's last token) into `out` at its offset."""
    assert self._mask_reader is not None
    bos = int(self._special.add_bos)
    doc_len_P = self._doc_lengths[doc_P]
    token_lo_P = np.maximum(start_P - bos, 0)
    token_hi_P = np.minimum(start_P + length_P - bos, doc_len_P)
    self._mask_reader.copy(out, doc_P, token_lo_P, token_hi_P, offset_P + (start_P < bos))
    if bos:
      out[offset_P[start_P == 0]] = 0
    if self._special.add_eos:
      # An empty document has no last token: its EOS keeps mask 0 (nothing of it is trained).
      ends_eos = (start_P + length_P == doc_len_P + bos + 1) & (doc_len_P > 0)
      eos_doc = doc_P[ends_eos]
      last = np.zeros(eos_doc.size, dtype=np.uint8)
      self._mask_reader.copy(last, eos_doc, doc_len_P[ends_eos] - 1, doc_len_P[ends_eos],
                             np.arange(eos_doc.size, dtype=np.int64))
      out[(offset_P + length_P - 1)[ends_eos]] = last

  def _mask_overlap(self, labels: np.ndarray, start_P: np.ndarray, length_P: np.ndarray,
                    offset_P: np.ndarray) -> None:
    """Sets -100 on the labels whose target is a repeated slot of a continuation chunk."""
    overlap = self._plan.overlap
    if overlap <= 0:
      return
    cont = start_P > 0
    # Targets at chunk slots 1..overlap-1 are repeats: labels at slots 0..overlap-2.
    n_P = np.minimum(overlap, length_P[cont]) - 1
    n_P = np.maximum(n_P, 0)
    if not n_P.sum():
      return
    total = int(n_P.sum())
    base = np.repeat(offset_P[cont], n_P)
    within = np.arange(total) - np.repeat(np.cumsum(n_P) - n_P, n_P)
    labels[base + within] = IGNORE_LABEL


class _FirstFitTree:
  """A max-tree over row capacities: the leftmost row with capacity >= need in O(log rows)."""

  def __init__(self, capacity: np.ndarray):
    size = 1 << max(0, int(capacity.size - 1).bit_length())
    tree = np.full(2 * size, -1, dtype=np.int64)
    tree[size:size + capacity.size] = capacity
    level = size
    while level > 1:
      tree[level // 2:level] = np.maximum(tree[level:2 * level:2], tree[level + 1:2 * level:2])
      level //= 2
    self._size = size
    self._tree = tree.tolist()

  def find(self, need: int) -> int:
    """Leftmost leaf with capacity >= need, or -1."""
    tree, i = self._tree, 1
    if tree[1] < need:
      return -1
    while i < self._size:
      i = 2 * i if tree[2 * i] >= need else 2 * i + 1
    return i - self._size

  def set(self, leaf: int, value: int) -> None:
    tree, i = self._tree, leaf + self._size
    tree[i] = value
    i //= 2
    while i:
      tree[i] = max(tree[2 * i], tree[2 * i + 1])
      i //= 2


class _LengthPool:
  """A multiset of pieces keyed by length: the largest piece of length <= c in O(log lengths)."""

  def __init__(self, pieces: list[int], lengths: list[int]):
    self._by_length: dict[int, list[int]] = {}
    for p, n in zip(pieces, lengths):
      self._by_length.setdefault(n, []).append(p)
    self._keys = sorted(self._by_length)
    self.count = len(pieces)
    self.tokens = int(sum(lengths))

  def largest_at_most(self, c: int) -> int:
    """The largest length <= c held, or 0."""
    i = bisect.bisect_right(self._keys, c)
    return self._keys[i - 1] if i else 0

  def smallest(self) -> int:
    return self._keys[0] if self._keys else 0

  def pop(self, n: int) -> int:
    """Removes and returns a piece of length n (the most recently added)."""
    stack = self._by_length[n]
    p = stack.pop()
    if not stack:
      del self._by_length[n]
      self._keys.pop(bisect.bisect_left(self._keys, n))
    self.count -= 1
    self.tokens -= n
    return p

  def push(self, p: int, n: int) -> None:
    stack = self._by_length.get(n)
    if stack is None:
      stack = self._by_length[n] = []
      bisect.insort(self._keys, n)
    stack.append(p)
    self.count += 1
    self.tokens += n


@dataclasses.dataclass
class _CapState:
  """Mutable state of the segment-cap post-pass (per piece: row and order key; per row: counts)."""

  seq_len: int
  max_segments: int
  length: np.ndarray      # int64 [pieces]
  row: np.ndarray         # int64 [pieces], -1 while a piece is in the pool
  key: np.ndarray         # int64 [pieces], order of the pieces inside a row
  count: np.ndarray       # int64 [rows] pieces per row
  used: np.ndarray        # int64 [rows] occupied slots per row
  next_key: int = 1 << 40


def _swap_into_rows(state: _CapState, smallest: np.ndarray, rows: np.ndarray) -> None:
  """Rows under the cap trade their smallest piece for >= 2 pool pieces that fill at least as
  many slots (largest-first fill, the first pick leaving room for a second), until the pool's
  pieces are long enough on average (>= seq_len / max_segments) for the cap not to bind."""
  pool_idx = np.flatnonzero(state.row < 0)
  pool = _LengthPool(pool_idx.tolist(), state.length[pool_idx].tolist())
  seq_len, cap = state.seq_len, state.max_segments
  for r, y in zip(rows.tolist(), smallest.tolist()):
    if pool.count * seq_len <= pool.tokens * cap:
      break
    n = int(state.count[r])
    if n >= cap or n == 0:
      continue
    ly = int(state.length[y])
    room = seq_len - int(state.used[r]) + ly
    slots, left, picks = cap - n + 1, room, []
    n_pick = pool.largest_at_most(left - pool.smallest())
    while n_pick and slots:
      picks.append((pool.pop(n_pick), n_pick))
      left -= n_pick
      slots -= 1
      n_pick = pool.largest_at_most(left)
    if len(picks) >= 2 and room - left >= ly:
      state.row[y] = -1
      pool.push(y, ly)
      for p, _ in picks:
        state.row[p] = r
        state.key[p] = state.next_key
        state.next_key += 1
      state.count[r] = n - 1 + len(picks)
      state.used[r] += room - left - ly
    else:
      for p, n_pick in picks:
        pool.push(p, n_pick)


def _first_fit_pool(state: _CapState) -> None:
  """Places the pool pieces, longest first, first-fit into rows with a free segment slot and
  room (existing rows in order, then new rows at the end)."""
  seq_len, cap = state.seq_len, state.max_segments
  num_rows = state.count.size
  pool = np.flatnonzero(state.row < 0)
  pool = pool[np.argsort(-state.length[pool], kind="stable")]
  cand = np.flatnonzero((state.count < cap) & (state.used < seq_len))
  targets = np.concatenate([cand, num_rows + np.arange(pool.size, dtype=np.int64)])
  free = np.concatenate([seq_len - state.used[cand],
                         np.full(pool.size, seq_len, dtype=np.int64)]).tolist()
  slots = np.concatenate([cap - state.count[cand],
                          np.full(pool.size, cap, dtype=np.int64)]).tolist()
  tree = _FirstFitTree(np.asarray(free, dtype=np.int64))
  placed = np.empty(pool.size, dtype=np.int64)
  for i, (p, need) in enumerate(zip(pool.tolist(), state.length[pool].tolist())):
    t = tree.find(need)
    placed[i] = t
    free[t] -= need
    slots[t] -= 1
    tree.set(t, free[t] if slots[t] else -1)
  state.row[pool] = targets[placed]
  state.key[pool] = state.next_key + np.arange(pool.size, dtype=np.int64)


def cap_segments_per_row(plan: PlanArrays, max_segments: int) -> PlanArrays:
  """Returns a plan in which no row holds more than `max_segments` pieces.

  The planners do not know about the cap, so it is enforced by a deterministic post-pass. FFD
  and BFD concentrate short pieces in their last rows, so simply moving the extra pieces out
  would leave those rows nearly empty; instead:

  1. Rows over the cap are dissolved: all their pieces go to a pool.
  2. Swap pass: every row under the cap, in row order, may trade its shortest piece for two or
     more pool pieces that fill at least as many slots (staying within the cap); the traded piece
     joins the pool. The pass stops once the pool's pieces average >= seq_len / max_segments.
  3. The pool, longest first, is placed first-fit (a max-tree over row capacities, O(log rows)
     per piece) into rows with a free segment slot and room; what fits nowhere opens new rows.
  4. Empty rows are dropped; inside a row, untouched pieces keep their order, added ones follow.

  Example: seq_len 8, cap 2, rows [[a:3, b:2, c:1], [d:4]]: row 0 is dissolved (pool a, b, c);
  row 1 trades d for a and b (5 slots >= 4); d and c go first-fit into the emptied row 0:
  [[d, c], [a, b]].

  Measured on 1M lognormal documents (mean 800, sigma 1.0) at seq_len 4096: +9.1% rows for cap
  8, +1.4% for 16, +0.18% for 32 (the lower bound with a cap is
  max(ceil(tokens / seq_len), ceil(pieces / cap))).

  Args:
    plan: the plan to cap.
    max_segments: the cap, >= 1.

  Returns:
    `plan` itself when no row exceeds the cap, else the re-packed plan.
  """
  counts = np.diff(np.asarray(plan.row_splits, dtype=np.int64))
  if counts.size == 0 or int(counts.max()) <= max_segments:
    return plan
  num_rows = counts.size
  row_of_piece = np.repeat(np.arange(num_rows, dtype=np.int64), counts)
  length = np.asarray(plan.length, dtype=np.int64)
  within = counts <= max_segments
  kept = within[row_of_piece]
  state = _CapState(
      seq_len=plan.seq_len, max_segments=max_segments, length=length,
      row=np.where(kept, row_of_piece, -1), key=np.arange(length.size, dtype=np.int64),
      count=np.where(within, counts, 0),
      used=np.bincount(row_of_piece[kept], weights=length[kept],
                       minlength=num_rows).astype(np.int64))
  by_length = np.lexsort((length, row_of_piece))  # each row's shortest piece first
  rows = np.flatnonzero(within & (counts > 0))
  _swap_into_rows(state, by_length[np.asarray(plan.row_splits[:-1], dtype=np.int64)[rows]], rows)
  _first_fit_pool(state)
  _, row = np.unique(state.row, return_inverse=True)  # drops empty rows, keeps row order
  perm = np.lexsort((state.key, row))
  row_splits = np.zeros(int(row.max()) + 2, dtype=np.int64)
  row_splits[1:] = np.cumsum(np.bincount(row))
  return dataclasses.replace(
      plan, row_splits=row_splits, doc=np.asarray(plan.doc)[perm],
      start=np.asarray(plan.start)[perm], length=np.asarray(plan.length)[perm])

"""Row construction: turns plan rows into the four int32 row features.

A plan row is a list of pieces `(doc, start, length)` over *virtual sequences* (see
docs/architecture.md, "Packing plan"): virtual slot 0 of document `d` is BOS (with `add_bos`), the
last virtual slot is EOS (with `add_eos`), the slots between are the document's tokens. This module
reads the tokens of those pieces (memory-mapped slices, never whole files) and builds `input_ids`,
`labels`, `segment_ids` and `segment_positions` for many rows at once with vectorized NumPy.
"""

from __future__ import annotations

import dataclasses
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


class RowBuilder:
  """Builds packed rows (dicts of int32 arrays) from plan rows and a token source.

  Algorithm, for a batch of plan row indices (index `-1` is an all-padding row):

  1. Gather the pieces of the requested rows: piece ranges `row_splits[r]:row_splits[r+1]` are
     concatenated with one `np.repeat`/`arange` trick (no loop over rows).
  2. Give every piece its flat output offset: `row * seq_len + (cumulative length of the earlier
     pieces of its row)`, and its segment id: 1 + (rank of the piece within its row).
  3. Copy tokens: one slice copy per piece from the memory-mapped document (`source[doc]`), plus
     the BOS/EOS slots where the piece covers virtual slot 0 / the last virtual slot.
  4. `segment_ids` and `segment_positions` for all real slots at once: `np.repeat` of the per-piece
     segment id, and `arange` minus the repeated piece offsets.
  5. `labels[i] = input_ids[i+1]` where slots `i` and `i+1` share a segment of the same row, else
     -100; then -100 on targets that are repeated overlap tokens of a continuation chunk.

  Tiny example (seq_len 10, add_bos and add_eos, bos 1, eos 2, document 0 = [5, 6], document 1 =
  [7, 8], so both virtual sequences have 4 slots): the row with pieces (0, 0, 4) and (1, 0, 4) is
  `input_ids = [1 5 6 2 1 7 8 2 0 0]`, `segment_ids = [1 1 1 1 2 2 2 2 0 0]`,
  `segment_positions = [0 1 2 3 0 1 2 3 0 0]`,
  `labels = [5 6 2 -100 7 8 2 -100 -100 -100]`.
  """

  def __init__(self, source: Any, plan: PlanArrays, *, special: SpecialTokens,
               doc_lengths: np.ndarray):
    """Creates the builder.

    Args:
      source: random-access sequence of 1-D integer arrays (`source[d]` = tokens of document d).
      plan: the plan arrays.
      special: BOS/EOS/padding ids.
      doc_lengths: int64 `[num_docs]` token counts of the source documents.
    """
    self._source = source
    self._plan = plan
    self._special = special
    self._doc_lengths = np.asarray(doc_lengths, dtype=np.int64)

  @property
  def seq_len(self) -> int:
    return self._plan.seq_len

  @property
  def num_rows(self) -> int:
    return self._plan.num_rows

  def build(self, rows: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """Returns the features of `rows` as int32 `[len(rows), seq_len]` arrays.

    Args:
      rows: plan row indices in `[0, num_rows)`, or -1 for an all-padding row.
    """
    plan, seq_len = self._plan, self._plan.seq_len
    rows_B = np.asarray(rows, dtype=np.int64).reshape(-1)
    batch = rows_B.shape[0]
    real_B = rows_B >= 0
    safe_B = np.where(real_B, rows_B, 0)
    lo_B = np.where(real_B, plan.row_splits[safe_B], 0).astype(np.int64)
    count_B = np.where(real_B, plan.row_splits[safe_B + 1] - lo_B, 0).astype(np.int64)
    num_pieces = int(count_B.sum())
    first_B = np.cumsum(count_B) - count_B  # rank of each row's first piece in the gathered list
    rank_P = np.arange(num_pieces, dtype=np.int64) - np.repeat(first_B, count_B)
    piece_P = np.repeat(lo_B, count_B) + rank_P
    doc_P = np.asarray(plan.doc[piece_P], dtype=np.int64)
    start_P = np.asarray(plan.start[piece_P], dtype=np.int64)
    length_P = np.asarray(plan.length[piece_P], dtype=np.int64)
    row_P = np.repeat(np.arange(batch, dtype=np.int64), count_B)
    cum_P = np.cumsum(length_P) - length_P  # flat offset among real slots
    row_used_first = cum_P[first_B[count_B > 0]] if num_pieces else cum_P[:0]
    row_base_P = np.repeat(row_used_first, count_B[count_B > 0])
    offset_P = row_P * seq_len + (cum_P - row_base_P)  # flat output offset of each piece

    input_ids = np.full(batch * seq_len, self._special.pad_id, dtype=np.int32)
    self._copy_tokens(input_ids, doc_P, start_P, length_P, offset_P)

    segment_ids = np.zeros(batch * seq_len, dtype=np.int32)
    positions = np.zeros(batch * seq_len, dtype=np.int32)
    num_real = int(length_P.sum())
    if num_real:
      piece_of_slot = np.repeat(np.arange(num_pieces, dtype=np.int64), length_P)
      within = np.arange(num_real, dtype=np.int64) - cum_P[piece_of_slot]
      slot = offset_P[piece_of_slot] + within
      segment_ids[slot] = (rank_P + 1)[piece_of_slot]
      positions[slot] = within
    input_ids_BxS = input_ids.reshape(batch, seq_len)
    segment_ids_BxS = segment_ids.reshape(batch, seq_len)
    labels_BxS = self._labels(input_ids_BxS, segment_ids_BxS)
    self._mask_overlap(labels_BxS.reshape(-1), start_P, length_P, offset_P)
    return {
        "input_ids": input_ids_BxS,
        "labels": labels_BxS,
        "segment_ids": segment_ids_BxS,
        "segment_positions": positions.reshape(batch, seq_len),
    }

  def _copy_tokens(self, out: np.ndarray, doc_P: np.ndarray, start_P: np.ndarray,
                   length_P: np.ndarray, offset_P: np.ndarray) -> None:
    """Writes each piece's slots (BOS, a slice of the document, EOS) into `out` at its offset."""
    special = self._special
    bos = int(special.add_bos)
    doc_len_P = self._doc_lengths[doc_P]
    token_lo_P = np.maximum(start_P - bos, 0)
    token_hi_P = np.minimum(start_P + length_P - bos, doc_len_P)
    dst_P = offset_P + (start_P < bos)  # a BOS slot comes first
    source = self._source
    for d, lo, hi, dst in zip(doc_P.tolist(), token_lo_P.tolist(), token_hi_P.tolist(),
                              dst_P.tolist()):
      if hi > lo:
        out[dst:dst + hi - lo] = source[d][lo:hi]
    if special.add_bos:
      out[offset_P[start_P == 0]] = special.bos_id
    if special.add_eos:
      ends_eos = start_P + length_P == doc_len_P + bos + 1
      out[(offset_P + length_P - 1)[ends_eos]] = special.eos_id

  @staticmethod
  def _labels(input_ids_BxS: np.ndarray, segment_ids_BxS: np.ndarray) -> np.ndarray:
    """Next-token targets within a segment, -100 elsewhere."""
    labels_BxS = np.full_like(input_ids_BxS, IGNORE_LABEL)
    same_BxS = ((segment_ids_BxS[:, 1:] == segment_ids_BxS[:, :-1])
                & (segment_ids_BxS[:, :-1] != 0))
    labels_BxS[:, :-1] = np.where(same_BxS, input_ids_BxS[:, 1:], IGNORE_LABEL)
    return labels_BxS

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


def cap_segments_per_row(plan: PlanArrays, max_segments: int) -> PlanArrays:
  """Returns a plan in which no row holds more than `max_segments` pieces.

  The planners do not know about the cap, so it is enforced by a deterministic post-pass:

  1. Every row keeps its first `max_segments` pieces (in plan order); the rest overflow.
  2. The overflow pieces, sorted by decreasing length (ties by plan order), are placed first-fit
     into the rows that still have both free slots and a free segment slot, in row order; a piece
     that fits nowhere opens a new row at the end of the plan.
  3. Pieces keep their (doc, start, length); the plan is rebuilt row by row, kept pieces first.

  Example: seq_len 8, cap 2, rows [[a:3, b:2, c:1], [d:4]] -> c overflows and goes to row 1,
  giving [[a, b], [d, c]].

  Args:
    plan: the plan to cap.
    max_segments: the cap, >= 1.

  Returns:
    `plan` itself when no row exceeds the cap, else the re-packed plan.
  """
  counts = np.diff(np.asarray(plan.row_splits, dtype=np.int64))
  if counts.size == 0 or int(counts.max()) <= max_segments:
    return plan
  row_of_piece = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
  rank = np.arange(row_of_piece.size, dtype=np.int64) - np.repeat(
      np.asarray(plan.row_splits[:-1], dtype=np.int64), counts)
  length = np.asarray(plan.length, dtype=np.int64)
  overflow = np.flatnonzero(rank >= max_segments)
  kept = rank < max_segments
  used = np.bincount(row_of_piece[kept], weights=length[kept], minlength=counts.size)
  free = plan.seq_len - used.astype(np.int64)
  slots = max_segments - np.minimum(counts, max_segments)
  free = np.where(slots > 0, free, 0)
  order = overflow[np.argsort(-length[overflow], kind="stable")]
  new_row = row_of_piece.copy()
  new_rank = rank.copy()
  extra_free: list[int] = []
  extra_slots: list[int] = []
  for p in order.tolist():
    need = int(length[p])
    fits = np.flatnonzero(free >= need)
    if fits.size:
      r = int(fits[0])
      new_row[p] = r
      new_rank[p] = max_segments - slots[r]
      free[r] -= need
      slots[r] -= 1
      if slots[r] == 0:
        free[r] = 0
      continue
    for j, (f, s) in enumerate(zip(extra_free, extra_slots)):
      if f >= need and s > 0:
        break
    else:
      j = len(extra_free)
      extra_free.append(plan.seq_len)
      extra_slots.append(max_segments)
    new_row[p] = counts.size + j
    new_rank[p] = max_segments - extra_slots[j]
    extra_free[j] -= need
    extra_slots[j] -= 1
  perm = np.lexsort((new_rank, new_row))
  num_rows = counts.size + len(extra_free)
  row_splits = np.zeros(num_rows + 1, dtype=np.int64)
  row_splits[1:] = np.cumsum(np.bincount(new_row, minlength=num_rows))
  return dataclasses.replace(
      plan, row_splits=row_splits, doc=np.asarray(plan.doc)[perm],
      start=np.asarray(plan.start)[perm], length=np.asarray(plan.length)[perm])

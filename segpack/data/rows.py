"""Row construction: turns plan rows into the four int32 row features.

A plan row is a list of pieces `(doc, start, length)` over *virtual sequences* (see
docs/architecture.md, "Packing plan"): virtual slot 0 of document `d` is BOS (with `add_bos`), the
last virtual slot is EOS (with `add_eos`), the slots between are the document's tokens. This module
reads the tokens of those pieces (memory-mapped slices, never whole files) and builds `input_ids`,
`labels`, `segment_ids` and `segment_positions` for many rows at once with vectorized NumPy.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

import numpy as np

from segpack.data.options import SpecialTokens
from segpack.loss import IGNORE_INDEX
from segpack.packing.plan_format import Plan
from segpack.shards.reader import make_mask_reader, make_token_reader

FEATURES = ("input_ids", "labels", "segment_ids", "segment_positions")
PADDING_ROW = -1


class RowBuilder:
  """Builds packed rows (dicts of int32 arrays) from plan rows and a token source.

  Algorithm, for a batch of plan row indices (index `-1` is an all-padding row):

  1. Gather the pieces of the requested rows: piece ranges `row_splits[r]:row_splits[r+1]` are
     concatenated with one `np.repeat`/`arange` trick (no loop over rows).
  2. Give every piece its flat output offset: `row * seq_len + (cumulative length of the earlier
     pieces of its row)`, and its segment id: 1 + (rank of the piece within its row).
  3. Copy tokens: one slice copy per piece from the memory-mapped token file (a
     `ShardTokenReader`, which refuses ids >= the manifest's `vocab_size`, or `source[doc]` for
     other sources), plus the BOS/EOS slots where the piece covers virtual slot 0 / the last
     virtual slot.
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

  def __init__(self, source: Any, plan: Plan, *, special: SpecialTokens,
               doc_lengths: np.ndarray, loss_mask: bool = False,
               doc_sources: np.ndarray | None = None):
    """Creates the builder.

    Args:
      source: random-access sequence of 1-D integer arrays (`source[d]` = tokens of document d).
      plan: the packing plan (its `seq_len`, `overlap` and arrays are read).
      special: BOS/EOS/padding ids.
      doc_lengths: int32 or int64 `[num_docs]` token counts of the source documents.
      loss_mask: apply the source's per-token loss mask (`source.loss_mask(d)`, 1 = trained) to
        the labels.
      doc_sources: None, or int `[num_docs]`: the mixture source of every document; then rows
        also carry `segment_sources`, each slot's document's source (-1 on padding).
    """
    self._reader = make_token_reader(source)
    self._mask_reader = make_mask_reader(source) if loss_mask else None
    self._plan = plan
    self._special = special
    lengths = np.asarray(doc_lengths)  # int32 lengths (a mixture's draw) are kept, not widened
    self._doc_lengths = lengths if lengths.dtype in (np.int32, np.int64) else lengths.astype(
        np.int64)
    self._doc_sources = None if doc_sources is None else np.asarray(doc_sources, np.int32)
    self._views: Plan | None = None

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    state["_views"] = None  # The plan pickles as file references when memory-mapped.
    return state

  def _plan_views(self) -> Plan:
    """The plan with plain ndarray views of its arrays (indexing `np.memmap` objects is slow)."""
    if self._views is None:
      p = self._plan
      self._views = dataclasses.replace(
          p, row_splits=np.asarray(p.row_splits), doc=np.asarray(p.doc),
          start=np.asarray(p.start), length=np.asarray(p.length))
    return self._views

  @property
  def seq_len(self) -> int:
    return self._plan.seq_len

  @property
  def num_rows(self) -> int:
    return self._plan.num_rows

  @property
  def plan(self) -> Plan:
    return self._plan

  def with_plan(self, plan: Plan) -> "RowBuilder":
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
    labels_BxS[:, -1] = IGNORE_INDEX
    labels_BxS.reshape(-1)[offset_P + length_P - 1] = IGNORE_INDEX
    for b, n in enumerate(used_B.tolist()):
      labels_BxS[b, n:] = IGNORE_INDEX
    self._mask_overlap(labels_BxS.reshape(-1), start_P, length_P, offset_P)
    if self._mask_reader is not None:
      trained = np.zeros(batch * seq_len, dtype=np.uint8)
      self._copy_mask(trained, doc_P, start_P, length_P, offset_P)
      trained_BxS = trained.reshape(batch, seq_len)
      labels_BxS[:, :-1][trained_BxS[:, 1:] == 0] = IGNORE_INDEX
    out = {
        "input_ids": input_ids_BxS,
        "labels": labels_BxS,
        "segment_ids": segment_ids_BxS,
        "segment_positions": positions_BxS,
    }
    if self._doc_sources is not None:
      source_real = np.repeat(self._doc_sources[doc_P], length_P)
      sources_BxS = np.full((batch, seq_len), -1, dtype=np.int32)
      for b, (a, n) in enumerate(zip(src_B, used_B.tolist())):
        sources_BxS[b, :n] = source_real[a:a + n]
      out["segment_sources"] = sources_BxS
    return out

  def build_row(self, row: int) -> dict[str, np.ndarray]:
    """The features of one plan row (-1: an all-padding row) as int32 `[seq_len]` arrays.

    Equal to `build([row])` (the tests check it), but with a short loop over the row's pieces
    instead of batch-wide gathers, which is faster for one row.
    """
    plan, seq_len, special = self._plan_views(), self._plan.seq_len, self._special
    input_ids = np.full(seq_len, special.pad_id, dtype=np.int32)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
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
        labels[:-1][trained[1:] == 0] = IGNORE_INDEX
    out = {"input_ids": input_ids, "labels": labels, "segment_ids": segment_ids,
           "segment_positions": positions}
    if self._doc_sources is not None:
      sources = np.full(seq_len, -1, dtype=np.int32)
      if row >= 0:
        sources[:int(length_P.sum())] = np.repeat(self._doc_sources[doc_P], length_P)
      out["segment_sources"] = sources
    return out

  def _copy_tokens(self, out: np.ndarray, doc_P: np.ndarray, start_P: np.ndarray,
                   length_P: np.ndarray, offset_P: np.ndarray) -> None:
    """Writes each piece's slots (BOS, a slice of the document, EOS) into `out` at its offset."""
    special = self._special
    bos = int(special.add_bos)
    doc_len_P = self._doc_lengths[doc_P].astype(np.int64)
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
    doc_len_P = self._doc_lengths[doc_P].astype(np.int64)
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
    labels[base + within] = IGNORE_INDEX

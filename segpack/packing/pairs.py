"""Plans for preference pairs: each pair's two sequences placed whole, in one row.

A preference dataset stores pair `k` as documents `2k` (chosen) and `2k + 1` (rejected), each the
prompt followed by one completion. `plan_pairs` packs *pairs* as units with any packer of
`segpack.packing.STRATEGIES`, then writes each unit out as the pieces a row shows:

- without a shared prefix: the chosen sequence, then the rejected one (two segments);
- with `shared_prefix=True`: the prompt once, then two branches, chosen and rejected, which
  both start at the prompt's last slot (three segments). That slot sits in both branches
  because its logits predict each completion's first token; the prompt segment holds the
  slots before it. Attention lets a branch see its prompt segment and itself, never its
  sibling (`segpack.attention.segment_attention(prefix_segment_ids=...)`).

A pair can never be split across rows, so never across steps or processes: rows are the unit
every batch and process split takes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from segpack.errors import UserError
from segpack.packing import planner
from segpack.packing.plan_format import Plan

__all__ = ["PairPlan", "PairTooLongError", "ROLE_CHOSEN", "ROLE_PROMPT", "ROLE_REJECTED",
           "plan_pairs"]

ROLE_PROMPT, ROLE_CHOSEN, ROLE_REJECTED = 0, 1, 2


class PairTooLongError(UserError, ValueError):
  """A pair does not fit one row and truncation was not asked for."""


@dataclasses.dataclass(frozen=True, eq=False)
class PairPlan:
  """A `Plan` whose pieces are pairs' sequences, with what each piece is.

  Attributes:
    plan: the rows; piece `i` is a slice of document `plan.doc[i]` (`2k` or `2k + 1`).
    pair: int64 `[num_pieces]`: the pair of every piece.
    role: int8 `[num_pieces]`: `ROLE_PROMPT`, `ROLE_CHOSEN` or `ROLE_REJECTED`.
    pairs_per_row: the most pairs any row holds (a static bound for per-pair arrays).
    stats: `pairs`, `kept`, `truncated`, `dropped` (pairs with no completion slot left after
      truncation), `shared` (pairs laid out with their prompt once), `slots_saved` (slots
      sharing saved), plus the unit plan's `rows`, `tokens`, `slots`.
  """

  plan: Plan
  pair: np.ndarray
  role: np.ndarray
  pairs_per_row: int
  stats: dict[str, Any]

  @property
  def num_rows(self) -> int:
    return self.plan.num_rows


def _checked(name: str, value: Any, size: int | None = None) -> np.ndarray:
  array = np.asarray(value)
  if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
    raise PairTooLongError(f"plan_pairs: {name} must be a 1-D integer array, got "
                           f"{array.dtype} {array.shape}")
  if size is not None and array.size != size:
    raise PairTooLongError(f"plan_pairs: {name} has {array.size} entries, chosen_lengths "
                           f"{size}")
  return array.astype(np.int64)


def _units(c: np.ndarray, r: np.ndarray, p: np.ndarray, shared: bool) -> tuple[np.ndarray, ...]:
  """Slots of each pair laid out: `(unit, prompt segment)`."""
  s = np.where(p >= 2, p - 1, 0) if shared else np.zeros_like(p)
  return c + r - s, s


def _truncate(c, r, p, seq_len: int, shared: bool):
  """Keep-start truncation: both sequences cut to their first `L` slots, the largest `L` that
  fits the pair in a row; `L` below `p + 1` leaves no completion slot (the pair is dropped)."""
  lo = np.zeros_like(c)
  hi = np.maximum(c, r)
  while np.any(lo < hi):  # binary search of the largest fitting L, per pair
    mid = (lo + hi + 1) // 2
    cm, rm = np.minimum(c, mid), np.minimum(r, mid)
    fits = _units(cm, rm, np.minimum(p, mid), shared)[0] <= seq_len
    lo = np.where(fits, mid, lo)
    hi = np.where(fits, hi, mid - 1)
  return np.minimum(c, lo), np.minimum(r, lo), lo >= p + 1


def plan_pairs(*, chosen_lengths: Any, rejected_lengths: Any, prompt_lengths: Any,
               seq_len: int, strategy: str = "ffd", shared_prefix: bool = False,
               truncate: bool = False, tie_seed: Any = None) -> PairPlan:
  """Packs pairs whole into rows of `seq_len` slots.

  Algorithm:
    1. Each pair is a unit of `c + r` slots (`c`, `r`: its sequences' virtual slots); with
       `shared_prefix`, of `c + r - s`, `s = p - 1` the prompt slots before the last (`p`:
       the prompt's virtual slots, the same in both sequences; no sharing when `p < 2`).
    2. A unit longer than `seq_len` is refused, naming the pair; with `truncate`, both its
       sequences are cut to their first `L` slots for the largest `L` that fits (the pair is
       dropped, and counted, when `L <= p`: no completion slot left).
    3. `strategy` packs the units (`segpack.packing.plan`, exact FFD by default).
    4. Each unit becomes its pieces, in this order: the prompt `(2k, 0, s)` when shared, then
       chosen `(2k, s, c - s)` and rejected `(2k + 1, s, r - s)`.

  Example: seq_len 10, pairs (c, r, p) = (4, 3, 2) and (5, 5, 3). Without sharing the units are
  7 and 10: FFD puts the 10 in row 0 and the 7 in row 1. With sharing they are 6 and 8 (the
  second saves its 2 prompt slots before the last): rows [8] and [6], pieces of row 0
  `(2, 0, 2) (2, 2, 3) (3, 2, 3)`.

  Args:
    chosen_lengths: int `[num_pairs]` virtual slots of each chosen sequence (BOS/EOS counted).
    rejected_lengths: int `[num_pairs]`, the same for the rejected sequences.
    prompt_lengths: int `[num_pairs]` virtual slots of each pair's prompt (before its first
      completion slot); both sequences begin with these same slots.
    seq_len: slots per row.
    strategy: a packer of `segpack.packing.STRATEGIES`.
    shared_prefix: lay each pair out with its prompt once (step 1).
    truncate: cut pairs that do not fit (step 2) instead of refusing them.
    tie_seed: as `segpack.packing.plan`'s.

  Raises:
    PairTooLongError: a pair longer than a row without `truncate`; bad arrays.
  """
  c = _checked("chosen_lengths", chosen_lengths)
  r = _checked("rejected_lengths", rejected_lengths, c.size)
  p = _checked("prompt_lengths", prompt_lengths, c.size)
  if c.size == 0:
    raise PairTooLongError("plan_pairs: no pair to pack (chosen_lengths is empty)")
  unit, _ = _units(c, r, p, shared_prefix)
  long = np.flatnonzero(unit > seq_len)
  truncated, kept = 0, np.ones(c.size, bool)
  if long.size and not truncate:
    k = int(long[0])
    raise PairTooLongError(
        f"pair {k} (documents {2 * k}, {2 * k + 1}) needs {int(unit[k])} slots, more than a "
        f"row of seq_len={seq_len} ({long.size} pair(s) do not fit); raise seq_len or pass "
        f"truncate=True to cut pairs to their first slots")
  if long.size:
    c, r = c.copy(), r.copy()
    c[long], r[long], ok = _truncate(c[long], r[long], p[long], seq_len, shared_prefix)
    kept[long[~ok]] = False
    truncated = int(ok.sum())
  index = np.flatnonzero(kept)
  if index.size == 0:
    raise PairTooLongError(f"plan_pairs: no pair keeps a completion slot in rows of "
                           f"seq_len={seq_len}")
  unit, s = _units(c[index], r[index], p[index], shared_prefix)
  units = planner.plan(unit, seq_len, strategy=strategy, tie_seed=tie_seed)
  return _expand(units, index, c[index], r[index], s, stats=dict(
      pairs=int(c.size), kept=int(index.size), truncated=truncated,
      dropped=int(c.size - index.size), shared=int(np.count_nonzero(s)),
      slots_saved=int(s.sum()), rows=int(units.num_rows), tokens=int(unit.sum()),
      slots=int(units.num_rows) * int(seq_len)))


def _expand(units: Plan, index: np.ndarray, c: np.ndarray, r: np.ndarray, s: np.ndarray,
            *, stats: dict[str, Any]) -> PairPlan:
  """Step 4: every unit piece as its two or three pieces, in row order."""
  u = np.asarray(units.doc, np.int64)  # the unit (kept pair) of every unit piece
  per_unit = np.where(s[u] > 0, 3, 2)
  row_of_piece = np.repeat(np.arange(units.num_rows), np.diff(units.row_splits))
  pieces_per_row = np.bincount(row_of_piece, weights=per_unit, minlength=units.num_rows)
  row_splits = np.concatenate([[0], np.cumsum(pieces_per_row, dtype=np.int64)])
  k = np.repeat(u, per_unit)  # the unit of every output piece
  first = np.repeat(np.cumsum(per_unit) - per_unit, per_unit)
  slot = np.arange(k.size) - first  # 0, 1[, 2] within the unit
  shared = s[k] > 0
  role = np.where(shared, slot, slot + 1).astype(np.int8)
  pair = index[k]
  doc = 2 * pair + (role == ROLE_REJECTED)
  start = np.where(role == ROLE_PROMPT, 0, s[k])
  length = np.select([role == ROLE_PROMPT, role == ROLE_CHOSEN], [s[k], c[k] - s[k]],
                     r[k] - s[k])
  seq_len = units.seq_len
  plan = Plan(seq_len=seq_len, overlap=0, extra_tokens=0, strategy=units.strategy,
              row_splits=row_splits,
              doc=doc.astype(np.int64 if doc.size and doc.max() >= 2**31 else np.int32),
              start=start.astype(np.int32),
              length=length.astype(np.uint16 if seq_len <= 65535 else np.int32),
              stats=dict(stats))
  per_row = np.diff(units.row_splits)
  return PairPlan(plan=plan, pair=pair.astype(np.int64), role=role,
                  pairs_per_row=int(per_row.max(initial=0)), stats=stats)

"""Plans for groups of completions: each prompt with all its completions, whole, in one row.

An RL step samples `G` completions of every prompt (a *group*). `plan_groups` packs groups as
units with any packer of `segpack.packing.STRATEGIES` (exact FFD by default), so a group is
never split across rows, and so never across steps or processes. A group is laid out as:

- `layout="shared"`: the prompt once, then one branch per completion. A branch starts at the
  prompt's last slot (its logits predict the completion's first token), so the prompt piece
  holds the `p - 1` slots before it; attention lets a branch see its prompt piece and itself,
  never a sibling (`segpack.attention.segment_attention(prefix_segment_ids=...)`).
- `layout="copied"`: every completion after its own copy of the prompt (`G` sequences).

A prompt of one slot has no slot before its last: its group is laid out as copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from segpack.errors import UserError
from segpack.packing import planner

__all__ = ["GroupPlan", "GroupTooLongError", "LAYOUTS", "PROMPT", "group_slots", "plan_groups"]

LAYOUTS = ("shared", "copied")
PROMPT = -1  # `GroupPlan.member` of a group's shared prompt piece


class GroupTooLongError(UserError, ValueError):
  """A group (a prompt and all its completions) does not fit one row, or bad lengths."""


@dataclasses.dataclass(frozen=True, eq=False)
class GroupPlan:
  """Rows of whole groups, piece by piece in row order.

  Attributes:
    seq_len: slots per row.
    row_splits: int64 `[num_rows + 1]`: row `r` holds pieces `row_splits[r]:row_splits[r + 1]`.
    group: int64 `[num_pieces]`: the group of every piece.
    member: int32 `[num_pieces]`: `PROMPT` for a shared prompt piece, else the completion `k`
      (0..G-1) whose sequence (prompt + completion) the piece shows.
    start: int32 `[num_pieces]`: the piece's first slot within that sequence (a shared branch
      starts at `p - 1`, everything else at 0).
    length: int32 `[num_pieces]`: its slots.
    stats: `groups`, `completions`, `rows`, `tokens` (slots used), `slots`, `slots_saved`
      (prompt slots not copied).
  """

  seq_len: int
  row_splits: np.ndarray
  group: np.ndarray
  member: np.ndarray
  start: np.ndarray
  length: np.ndarray
  stats: dict[str, Any]

  @property
  def num_rows(self) -> int:
    return int(self.row_splits.size - 1)


def _lengths(prompt_lengths: Any, completion_lengths: Any) -> tuple[np.ndarray, list[np.ndarray]]:
  p = np.asarray(prompt_lengths)
  if p.ndim != 1 or not p.size or not np.issubdtype(p.dtype, np.integer):
    raise GroupTooLongError(f"plan_groups: prompt_lengths must be a non-empty 1-D integer "
                            f"array, got {p.dtype} {p.shape}")
  if len(completion_lengths) != p.size:
    raise GroupTooLongError(f"plan_groups: completion_lengths has {len(completion_lengths)} "
                            f"groups, prompt_lengths {p.size}")
  c = [np.asarray(x, np.int64).reshape(-1) for x in completion_lengths]
  for g, (pg, cg) in enumerate(zip(p, c)):
    if pg < 1 or not cg.size or cg.min() < 1:
      raise GroupTooLongError(f"plan_groups: group {g} needs a prompt and completions of at "
                              f"least one slot each, got prompt {int(pg)}, completions "
                              f"{cg.tolist()}")
  return p.astype(np.int64), c


def group_slots(prompt_length: int, completion_lengths: Sequence[int], *, layout: str) -> int:
  """The slots a group takes in a row: `p - 1 + sum(1 + c_k)` shared, `sum(p + c_k)` copied."""
  c = np.asarray(completion_lengths, np.int64)
  if layout == "shared" and prompt_length >= 2:
    return int(prompt_length - 1 + c.size + c.sum())
  return int(c.size * prompt_length + c.sum())


def plan_groups(*, prompt_lengths: Any, completion_lengths: Sequence[Any], seq_len: int,
                layout: str = "shared", strategy: str = "ffd") -> GroupPlan:
  """Packs groups whole into rows of `seq_len` slots.

  Algorithm:
    1. Group `g` (prompt of `p` slots, completions of `c_k` slots) is a unit of
       `group_slots(p, c, layout)` slots; a unit longer than `seq_len` is refused, naming it.
    2. `strategy` packs the units (`segpack.packing.plan`, exact FFD by default).
    3. Each unit becomes its pieces in this order: shared, the prompt `(g, PROMPT, 0, p - 1)`
       then the branches `(g, k, p - 1, 1 + c_k)`; copied, the sequences `(g, k, 0, p + c_k)`.

  Example: seq_len 16, groups (p, c) = (5, [2, 3]) and (3, [4, 1, 2]). Shared, the units are
  4 + 3 + 4 = 11 and 2 + 5 + 2 + 3 = 12 slots: rows [12] and [11] (FFD, longest first); row 0
  is `(1, PROMPT, 0, 2) (1, 0, 2, 5) (1, 1, 2, 2) (1, 2, 2, 3)`. Copied, they are 15 and 16.

  Args:
    prompt_lengths: int `[num_groups]`: each prompt's slots.
    completion_lengths: per group, its completions' slots (any number per group).
    seq_len: slots per row.
    layout: one of `LAYOUTS`.
    strategy: a packer of `segpack.packing.STRATEGIES`.

  Raises:
    GroupTooLongError: a group longer than a row; bad lengths or layout.
  """
  if layout not in LAYOUTS:
    raise GroupTooLongError(f"plan_groups: layout must be one of {LAYOUTS}, got {layout!r}")
  p, c = _lengths(prompt_lengths, completion_lengths)
  units = np.asarray([group_slots(int(pg), cg, layout=layout) for pg, cg in zip(p, c)], np.int64)
  long = np.flatnonzero(units > seq_len)
  if long.size:
    g = int(long[0])
    raise GroupTooLongError(
        f"group {g} (a prompt of {int(p[g])} slots and {c[g].size} completions of up to "
        f"{int(c[g].max())}) needs {int(units[g])} slots, more than a row of seq_len={seq_len} "
        f"({long.size} group(s) do not fit)")
  rows = planner.plan(units, seq_len, strategy=strategy)
  return _expand(rows, p, c, layout=layout, units=units)


def _expand(rows: Any, p: np.ndarray, c: list[np.ndarray], *, layout: str,
            units: np.ndarray) -> GroupPlan:
  """Step 3: every unit as its pieces, in row order."""
  splits, group, member, start, length = [0], [], [], [], []
  for r in range(rows.num_rows):
    for u in rows.doc[rows.row_splits[r]:rows.row_splits[r + 1]]:
      g = int(u)
      shared = layout == "shared" and p[g] >= 2
      if shared:
        group.append(g), member.append(PROMPT), start.append(0), length.append(p[g] - 1)
      for k, ck in enumerate(c[g]):
        group.append(g), member.append(k)
        start.append(p[g] - 1 if shared else 0)
        length.append(1 + ck if shared else p[g] + ck)
    splits.append(len(group))
  copied = sum(int(cg.size * pg + cg.sum()) for pg, cg in zip(p, c))
  stats = dict(groups=int(p.size), completions=int(sum(cg.size for cg in c)),
               rows=int(rows.num_rows), tokens=int(units.sum()),
               slots=int(rows.num_rows) * int(rows.seq_len),
               slots_saved=copied - int(units.sum()))
  return GroupPlan(seq_len=int(rows.seq_len), row_splits=np.asarray(splits, np.int64),
                   group=np.asarray(group, np.int64), member=np.asarray(member, np.int32),
                   start=np.asarray(start, np.int32), length=np.asarray(length, np.int32),
                   stats=stats)

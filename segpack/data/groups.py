"""Rows of groups of completions: `group_rows`, each prompt with all its completions in one row.

`segpack.packing.groups.plan_groups` decides which groups fill each row; `group_rows` writes the
rows out as the trainer's arrays: the four row features, the shared prompts' prefix ids, and
per slot the completion whose token its label is, with any per-completion or per-token values
(advantages, old and reference log-probs) at those slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from segpack.loss.labels import IGNORE_INDEX
from segpack.packing import groups as groups_lib

__all__ = ["group_rows"]


def _row_arrays(num_rows: int, seq_len: int, names: Sequence[str]) -> dict[str, np.ndarray]:
  out = {k: np.zeros((num_rows, seq_len), np.int32)
         for k in ("input_ids", "segment_ids", "segment_positions", "prefix_segment_ids")}
  out["labels"] = np.full((num_rows, seq_len), IGNORE_INDEX, np.int32)
  out["completion_index"] = np.full((num_rows, seq_len), -1, np.int32)
  out.update({name: np.zeros((num_rows, seq_len), np.float32) for name in names})
  return out


def group_rows(plan: groups_lib.GroupPlan, *, prompts: Sequence[Sequence[int]],
               completions: Sequence[Sequence[Sequence[int]]],
               completion_values: Mapping[str, Sequence[Sequence[float]]] | None = None,
               token_values: Mapping[str, Sequence[Sequence[Sequence[float]]]] | None = None,
               num_rows: int | None = None) -> dict[str, np.ndarray]:
  """The rows of `plan` as `[num_rows, seq_len]` arrays.

  Algorithm, piece by piece (`plan`'s pieces in row order; segment ids 1.. in each row):
    1. A piece shows slots `start .. start + length` of its sequence `prompt + completion`:
       `input_ids` those tokens, `segment_positions` their positions in the sequence (a branch
       continues its prompt), `prefix_segment_ids` the row's segment of the group's shared
       prompt on a branch's slots (0 elsewhere).
    2. A slot whose next sequence token is a completion token `i` gets that token as its label,
       the completion's flat index (`g`'s completions numbered after those of groups `< g`) as
       `completion_index`, and `token_values[name][g][k][i]`, `completion_values[name][g][k]`;
       every other slot keeps label -100, index -1, values 0.

  Example: a group with prompt `[a b c]` and completions `[x y]`, `[z]`, shared: the row is
  `[a b | c x y | c z]`, segment ids `[1 1 2 2 2 3 3]`, positions `[0 1 2 3 4 2 3]`, prefix ids
  `[0 0 1 1 1 1 1]`, labels `[- - x y - z -]`, completion index `[-1 -1 0 0 -1 1 -1]`.

  Args:
    plan: `plan_groups`' plan of these groups.
    prompts: per group, the prompt's ids.
    completions: per group, its completions' ids.
    completion_values: float values per completion (`[g][k]`), by name.
    token_values: float values per completion token (`[g][k][i]`), by name.
    num_rows: rows of the output (at least the plan's; the rest are empty rows); the plan's
      rows when None.

  Returns:
    `input_ids`, `labels`, `segment_ids`, `segment_positions`, `prefix_segment_ids`,
    `completion_index` (int32) and every named value (float32), each `[num_rows, seq_len]`.
  """
  completion_values = dict(completion_values or {})
  token_values = dict(token_values or {})
  rows = plan.num_rows if num_rows is None else int(num_rows)
  if rows < plan.num_rows:
    raise ValueError(f"group_rows: num_rows={rows} is fewer than the plan's {plan.num_rows} rows")
  out = _row_arrays(rows, plan.seq_len, [*completion_values, *token_values])
  first = np.concatenate([[0], np.cumsum([len(c) for c in completions])]).astype(np.int64)
  for r in range(plan.num_rows):
    at, prompt_segment = 0, 0
    for seg, piece in enumerate(range(plan.row_splits[r], plan.row_splits[r + 1]), start=1):
      g, k = int(plan.group[piece]), int(plan.member[piece])
      s, n = int(plan.start[piece]), int(plan.length[piece])
      prompt = np.asarray(prompts[g], np.int64)
      if k == groups_lib.PROMPT:
        sequence = prompt
        prompt_segment = seg
      else:
        sequence = np.concatenate([prompt, np.asarray(completions[g][k], np.int64)])
      span = slice(at, at + n)
      out["input_ids"][r, span] = sequence[s:s + n]
      out["segment_ids"][r, span] = seg
      out["segment_positions"][r, span] = np.arange(s, s + n)
      if k != groups_lib.PROMPT:
        if s > 0:
          out["prefix_segment_ids"][r, span] = prompt_segment
        nxt = np.arange(s + 1, s + n + 1)  # each slot's next sequence position
        trained = (nxt >= prompt.size) & (nxt < sequence.size)
        slots = at + np.flatnonzero(trained)
        token = nxt[trained] - prompt.size
        out["labels"][r, slots] = sequence[nxt[trained]]
        out["completion_index"][r, slots] = first[g] + k
        for name, values in completion_values.items():
          out[name][r, slots] = float(values[g][k])
        for name, values in token_values.items():
          out[name][r, slots] = np.asarray(values[g][k], np.float32)[token]
      at += n
  return out

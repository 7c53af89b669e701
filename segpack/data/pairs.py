"""Rows of preference pairs: `pack_pairs`, each pair's two sequences in one row.

A preference dataset (`segpack tokenize --format preference`) stores pair `k` as documents `2k`
(chosen) and `2k + 1` (rejected), each with a loss mask on its completion. `pack_pairs` plans
the pairs as units (`segpack.packing.pairs.plan_pairs`) and serves the rows as a
`PackedDataset`, so `StreamBatches`, epochs, shuffling and resuming work as for any rows.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from segpack.data import epoch_plans
from segpack.data import options
from segpack.data import rows as rows_lib
from segpack.data import sources
from segpack.data import subset
from segpack.data.options import PipelineConfigError, SpecialTokens
from segpack.data.packed import PackedDataset
from segpack.errors import UserError
from segpack.packing import pairs as pairs_lib
from segpack.packing.options import PlanOptions

__all__ = ["NotPreferenceDataError", "PAIR_FEATURES", "PairRowBuilder", "pack_pairs",
           "prompt_lengths"]

# `[B, J]` features (J = the most pairs a row holds): each pair's segments in its row and index.
PAIR_FEATURES = ("pair_chosen_segment", "pair_rejected_segment", "pair_index")
REFERENCE_FEATURES = ("ref_chosen_logp", "ref_rejected_logp")


class NotPreferenceDataError(UserError, ValueError):
  """The source does not hold preference pairs (documents 2k, 2k + 1 with loss masks)."""


def prompt_lengths(source: Any, lengths: np.ndarray, *, add_bos: bool,
                   fn: str) -> np.ndarray:
  """Virtual slots before each pair's first trained slot (its prompt), the same in both of the
  pair's sequences; refuses a pair whose sequences begin differently before it."""
  out = np.zeros(lengths.size // 2, np.int64)
  for k in range(out.size):
    masks = [np.asarray(source.loss_mask(2 * k + i)) for i in (0, 1)]
    firsts = [int(np.argmax(m)) if m.any() else -1 for m in masks]
    if min(firsts) < 0:
      raise NotPreferenceDataError(f"{fn}: pair {k} (documents {2 * k}, {2 * k + 1}) has a "
                                   f"sequence with no trained token")
    first = min(firsts)
    same = np.array_equal(np.asarray(source[2 * k][:first]), np.asarray(source[2 * k + 1][:first]))
    if firsts[0] != firsts[1] or not same:
      raise NotPreferenceDataError(f"{fn}: pair {k} (documents {2 * k}, {2 * k + 1}): its two "
                                   f"sequences begin with different prompts")
    out[k] = first + int(add_bos)
  return out


class PairRowBuilder:
  """Rows of a pair plan: the four row features, plus the pairs' per-row arrays.

  Algorithm, for a batch of plan rows:
    1. `segpack.data.rows.RowBuilder` builds `input_ids`, `labels` (the loss mask applied: only
       completion tokens are trained), `segment_ids`, `segment_positions` over the pieces.
    2. A branch that starts after its shared prompt (`start > 0`) counts its positions from
       `start`, so it continues the prompt; `prefix_segment_ids` (with `shared_prefix`) gives
       its slots the prompt's segment id (0 elsewhere).
    3. Pair `j` of a row gets `pair_chosen_segment[j]`, `pair_rejected_segment[j]` (its
       segments' ids in the row) and `pair_index[j]` (its pair); unused `j` are 0, 0, -1.
    4. With reference scores set (`set_reference`), `ref_chosen_logp[j]` and
       `ref_rejected_logp[j]` are pair `pair_index[j]`'s.

  Example: a row holding pair 5 as chosen = slots 0-3 and rejected = slots 4-6 has
  `segment_ids = [1 1 1 1 2 2 2 0]`, `pair_chosen_segment = [1]`, `pair_rejected_segment = [2]`,
  `pair_index = [5]`.
  """

  def __init__(self, base: rows_lib.RowBuilder, pair_plan: pairs_lib.PairPlan, *,
               shared_prefix: bool):
    self._base = base
    self._pairs = pair_plan
    self._shared = bool(shared_prefix)
    self._reference: np.ndarray | None = None

  @property
  def seq_len(self) -> int:
    return self._base.seq_len

  @property
  def num_rows(self) -> int:
    return self._base.num_rows

  @property
  def plan(self):
    return self._base.plan

  @property
  def pairs_per_row(self) -> int:
    return max(self._pairs.pairs_per_row, 1)

  def set_reference(self, scores: np.ndarray | None) -> None:
    """Reference log-probs `[num_pairs, 2]` (chosen, rejected) for every pair index, or None."""
    self._reference = None if scores is None else np.asarray(scores, np.float64)

  def build(self, rows: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """The features of `rows` (`-1`: a padding row): `[B, S]` row features, `[B, J]` pairs."""
    rows_B = np.asarray(rows, np.int64).reshape(-1)
    out = self._base.build(rows_B)
    batch, width = rows_B.size, self.pairs_per_row
    pairs = {name: np.zeros((batch, width), np.int32) for name in PAIR_FEATURES}
    pairs["pair_index"][:] = -1
    prefix_BxS = np.zeros_like(out["segment_ids"]) if self._shared else None
    plan = self._base.plan
    for b, row in enumerate(rows_B.tolist()):
      if row >= 0:
        lo, hi = int(plan.row_splits[row]), int(plan.row_splits[row + 1])
        self._fill_row(b, lo, hi, out["segment_positions"][b], prefix_BxS, pairs)
    out.update(pairs)
    if prefix_BxS is not None:
      out["prefix_segment_ids"] = prefix_BxS
    if self._reference is not None:
      index = pairs["pair_index"]
      picked = self._reference[np.maximum(index, 0)]
      for i, name in enumerate(REFERENCE_FEATURES):
        out[name] = np.where(index >= 0, picked[..., i], 0.0).astype(np.float32)
    return out

  def _fill_row(self, b: int, lo: int, hi: int, positions_S: np.ndarray,
                prefix_BxS: np.ndarray | None, pairs: dict[str, np.ndarray]) -> None:
    """Steps 2 and 3 for row `b`, whose pieces are `lo:hi`."""
    plan = self._base.plan
    length = np.asarray(plan.length[lo:hi], np.int64)
    start = np.asarray(plan.start[lo:hi], np.int64)
    role = self._pairs.role[lo:hi]
    offset = np.concatenate([[0], np.cumsum(length)])
    j, prompt_seg = -1, 0
    for i in range(hi - lo):
      a, z = int(offset[i]), int(offset[i + 1])
      if start[i]:
        positions_S[a:z] += int(start[i])
      if role[i] == pairs_lib.ROLE_PROMPT:
        j, prompt_seg = j + 1, i + 1
      elif role[i] == pairs_lib.ROLE_CHOSEN and (i == 0 or role[i - 1] != pairs_lib.ROLE_PROMPT):
        j, prompt_seg = j + 1, 0
      pairs["pair_index"][b, j] = int(self._pairs.pair[lo + i])
      if role[i] == pairs_lib.ROLE_CHOSEN:
        pairs["pair_chosen_segment"][b, j] = i + 1
      elif role[i] == pairs_lib.ROLE_REJECTED:
        pairs["pair_rejected_segment"][b, j] = i + 1
      if prefix_BxS is not None and role[i] != pairs_lib.ROLE_PROMPT:
        prefix_BxS[b, a:z] = prompt_seg


def _pair_source(source: Any, *, fn: str, special_tokens: SpecialTokens):
  """The opened source and its lengths, refused unless it holds pairs with loss masks."""
  prepared = sources.prepare(source, fn=fn, special_tokens=special_tokens, loss_mask=None)
  record = getattr(prepared.source, "record", None)  # a shard dataset's manifest metadata
  if record is not None and prepared.loss_mask and "preference" not in record.extra:
    raise NotPreferenceDataError(
        f"{fn}: {prepared.source!r:.200} was not written as preference pairs (its manifest has "
        f"no 'preference' counts, which `segpack tokenize --format preference` writes): its "
        f"{prepared.lengths.size} documents are not chosen / rejected sequences")
  if not prepared.loss_mask or prepared.lengths.size % 2:
    raise NotPreferenceDataError(
        f"{fn}: {prepared.source!r:.200} is not a preference dataset (pairs of chosen and "
        f"rejected sequences with a loss mask, written by `segpack tokenize --format "
        f"preference`): it holds {prepared.lengths.size} documents"
        f"{'' if prepared.loss_mask else ' and no loss mask'}")
  return prepared


def pack_pairs(
    source: Any,
    *,
    plan: PlanOptions | None = None,
    seq_len: int | None = None,
    strategy: str | None = None,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    special_tokens: SpecialTokens = options.DEFAULT_SPECIAL_TOKENS,
    shared_prefix: bool = False,
    truncate: bool = False,
) -> PackedDataset:
  """Packs the pairs of a preference dataset into rows, each pair whole in one row.

  Every element is a dict: the int32 `[seq_len]` row features of `pack_dataset`, the int32
  `[J]` pair features of `PairRowBuilder` (`J` = `builder.pairs_per_row`), and with
  `shared_prefix` an int32 `[seq_len]` `prefix_segment_ids` for
  `segment_attention(prefix_segment_ids=...)`. The packing settings are one
  `segpack.PlanOptions` (`plan=`), or the keywords `seq_len` and `strategy` that spell it.

  Args:
    source: a preference dataset directory, `ShardSource` or random-access source whose
      documents `2k`, `2k + 1` are pair `k`'s chosen and rejected sequences with loss masks.
    plan: the packing settings, a `segpack.PlanOptions`: `seq_len` and `strategy` (the packer
      of the pairs); its other fields do not apply to pairs, which are planned whole, and must
      stay at their defaults (`truncate` cuts a pair longer than a row). None: the keywords
      `seq_len` and `strategy` spell it.
    seq_len: `PlanOptions.seq_len`, without `plan`.
    strategy: `PlanOptions.strategy`, without `plan` (None: "ffd").
    seed: shuffling seed; epoch `e` uses `(seed, e)`.
    shuffle: shuffle the rows of every epoch.
    num_epochs: None for an infinite dataset, else the number of epochs.
    special_tokens: BOS/EOS as for `pack_dataset` (none for data whose chat template writes
      them).
    shared_prefix: each pair's prompt once, chosen and rejected as branches after it.
    truncate: cut a pair longer than a row to its first slots (else refused by name).

  Raises:
    NotPreferenceDataError: the source is not a preference dataset, or a pair's sequences
      begin with different prompts.
    PairTooLongError: a pair longer than a row without `truncate`.
    PipelineConfigError: another bad argument.
  """
  fn = "pack_pairs"
  plan = options.plan_options(fn, plan, seq_len=seq_len, strategy=strategy)
  options.check_args(fn, plan=plan, seed=seed, num_epochs=num_epochs,
                     special_tokens=special_tokens)
  options.refuse_fields(
      fn, plan, ("long_docs", "max_segments_per_row", "batch_size", "pad_multiple"),
      why="pairs are planned whole, each in one row; truncate=True cuts a pair longer than a row")
  prepared = _pair_source(source, fn=fn, special_tokens=special_tokens)
  virtual = prepared.lengths + prepared.special.extra_tokens
  pair_plan = pairs_lib.plan_pairs(
      chosen_lengths=virtual[0::2], rejected_lengths=virtual[1::2],
      prompt_lengths=prompt_lengths(prepared.source, prepared.lengths,
                                    add_bos=prepared.special.add_bos, fn=fn),
      seq_len=int(plan.seq_len), strategy=plan.strategy, shared_prefix=shared_prefix,
      truncate=truncate)
  base = rows_lib.RowBuilder(prepared.source, pair_plan.plan, special=prepared.special,
                             doc_lengths=prepared.lengths, loss_mask=True)
  builder = PairRowBuilder(base, pair_plan, shared_prefix=shared_prefix)
  builders = epoch_plans.EpochBuilders(builder, planner=None, num_epochs=num_epochs)
  bound = int(np.diff(np.asarray(pair_plan.plan.row_splits)).max(initial=0))
  dataset = PackedDataset(builders, seed=int(seed), shuffle=bool(shuffle),
                          num_epochs=num_epochs, segment_bound=bound)
  dataset.pairs = pair_plan  # what was planned: truncated, dropped, shared pairs
  return dataset


def pair_builder(dataset: PackedDataset) -> PairRowBuilder:
  """The `PairRowBuilder` of a `pack_pairs` dataset (refused for other datasets)."""
  builder = getattr(dataset, "_builder", None)
  if not isinstance(builder, PairRowBuilder):
    raise PipelineConfigError(f"{dataset!r:.100} is not a pack_pairs dataset")
  return builder



def held_out_pairs(source: Any, *, share: float, salt: int = 0) -> tuple[Any, Any]:
  """`(train, held_out)`: the pairs of a preference dataset split by `held_out_mask` over
  pairs, each side a `DocumentSubset` whose documents are still chosen, rejected, chosen, ...

  Raises:
    PipelineConfigError: a share that leaves either side without a pair.
  """
  source = sources.open_source(source, fn="held_out_pairs")
  num_pairs = sources.document_lengths(source, fn="held_out_pairs").size // 2
  held = subset.held_out_mask(num_pairs, share=share, salt=salt)
  if held.all() or not held.any():
    raise PipelineConfigError(
        f"held_out_pairs: a held-out share of {share!r} of the {num_pairs} pairs of "
        f"{source!r:.200} leaves {'no training' if held.all() else 'no held-out'} pair; "
        f"change the share or pass held-out pairs of their own")

  def docs(pairs_mask):
    k = np.flatnonzero(pairs_mask)
    return np.stack([2 * k, 2 * k + 1], axis=1).reshape(-1)

  return (subset.DocumentSubset(source, ids=docs(~held), name=f"train_pairs{share}:{salt}"),
          subset.DocumentSubset(source, ids=docs(held), name=f"held_out_pairs{share}:{salt}"))

"""`PlanOptions`: the settings that decide a packing plan, one frozen group.

`pack_dataset`, `pack_minibatches`, `pack_pairs` and `segpack stats` take their packing settings
as one `PlanOptions` (in the style of `grain.ReadOptions`: keyword-only, typed, checked when
made), and the layers below them pass it on: a plan is a function of the documents' lengths,
the `PlanOptions`, and the slots every document adds (`extra_tokens`, its BOS and EOS, which the
data layer takes from its `SpecialTokens`).

Example:

    options = PlanOptions(seq_len=4096, long_docs=LongDocs(min_len=8))
    plan = options.plan(lengths, extra_tokens=2)  # = segpack.packing.plan(lengths, 4096, ...)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from segpack.errors import PipelineConfigError
from segpack.packing import cache as cache_lib
from segpack.packing import cap as cap_lib
from segpack.packing import planner as planner_lib
from segpack.packing.chunking import DEFAULT_LONG_DOCS, LONG_DOC_MODES, LongDocs
from segpack.packing.plan_format import Plan

__all__ = ["PlanOptions", "check_fields", "not_int"]


def not_int(value: Any) -> bool:
  """True unless `value` is a Python or NumPy integer (a bool is not taken for one)."""
  return isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
  """How documents are planned into rows: the packing settings every entry point shares.

  Every field is checked when the options are made (`PipelineConfigError` naming the field and
  echoing its value). Two options objects that are equal plan the same rows, and the plan cache
  key (`segpack.packing.plan_key`) is made of their fields.

  Attributes:
    seq_len: slots per row, an int >= 1.
    strategy: the packer, one of `segpack.packing.STRATEGIES` ("ffd", "bfd", "greedy", "pad",
      "sorted_pad").
    long_docs: splitting or truncating documents longer than a row, the overlap of consecutive
      chunks (in `[0, seq_len)`), and the minimum length of a kept document (a `LongDocs`).
    max_segments_per_row: None, or the most pieces (segments) a row may hold, an int >= 1:
      pieces beyond it move to other rows (`segpack.packing.cap`).
    batch_size: rows per batch of `sorted_pad`'s slot count (its `stats["slots"]`), an int >= 1;
      no other strategy reads it, and it changes no row.
    pad_multiple: the granularity of `sorted_pad`'s padded batch length (its `stats["slots"]`),
      an int >= 1; no other strategy reads it, and it changes no row.
  """

  seq_len: int
  strategy: str = "ffd"
  long_docs: LongDocs = DEFAULT_LONG_DOCS
  max_segments_per_row: int | None = None
  batch_size: int = 8
  pad_multiple: int = 128

  def __post_init__(self) -> None:
    check_fields("PlanOptions", seq_len=self.seq_len, strategy=self.strategy,
                 long_docs=self.long_docs, max_segments_per_row=self.max_segments_per_row,
                 batch_size=self.batch_size, pad_multiple=self.pad_multiple)

  def plan(self, lengths: Any, *, extra_tokens: int, tie_seed: Any = None) -> Plan:
    """`segpack.packing.plan` of `lengths` with these options, capped at
    `max_segments_per_row` when it is set (`segpack.packing.cap.cap_segments_per_row`).

    Args:
      lengths: 1-D integer document lengths (tokens, without BOS/EOS).
      extra_tokens: virtual slots every document adds (its BOS and EOS).
      tie_seed: as `segpack.packing.plan`'s.
    """
    plan = planner_lib.plan(lengths, int(self.seq_len), strategy=self.strategy,
                            long_docs=self.long_docs, extra_tokens=extra_tokens,
                            batch_size=self.batch_size, pad_multiple=self.pad_multiple,
                            tie_seed=tie_seed)
    if self.max_segments_per_row is None:
      return plan
    return cap_lib.cap_segments_per_row(plan, int(self.max_segments_per_row))

  def load_or_plan(self, lengths: Any, *, extra_tokens: int,
                   cache_dir: str | os.PathLike | None, key: str | None = None) -> Plan:
    """`segpack.packing.load_or_plan` of `lengths` with these options: the cached plan (the
    capped one with `max_segments_per_row`), or planned and cached.

    Args:
      lengths: 1-D integer document lengths.
      extra_tokens: virtual slots every document adds.
      cache_dir: directory of cached plans; None disables the cache.
      key: a fingerprint of the documents; None hashes `lengths`.
    """
    return cache_lib.load_or_plan(
        lengths, int(self.seq_len), cache_dir=cache_dir, key=key, strategy=self.strategy,
        long_docs=self.long_docs, extra_tokens=extra_tokens, batch_size=self.batch_size,
        pad_multiple=self.pad_multiple, max_segments_per_row=self.max_segments_per_row)

  def repack_planner(self, lengths: Any, *, extra_tokens: int,
                     seed: int) -> planner_lib.RepackPlanner:
    """The `segpack.packing.RepackPlanner` of `lengths` with these options (a plan for every
    epoch, seeded by `(seed, epoch)`); refused with `max_segments_per_row`, whose cap could
    change the row count between epochs."""
    if self.max_segments_per_row is not None:
      raise PipelineConfigError(
          f"PlanOptions.repack_planner: max_segments_per_row={self.max_segments_per_row!r} is "
          f"not supported (the cap could change the row count between epochs)")
    return planner_lib.RepackPlanner(
        lengths, int(self.seq_len), seed=seed, strategy=self.strategy, long_docs=self.long_docs,
        extra_tokens=extra_tokens, batch_size=self.batch_size, pad_multiple=self.pad_multiple)


def check_fields(owner: str, *, seq_len: Any, strategy: Any, long_docs: Any,
                 max_segments_per_row: Any = None, batch_size: Any = 8,
                 pad_multiple: Any = 128) -> None:
  """Validates the fields of a `PlanOptions` (the keyword spelling of an entry point too).

  Args:
    owner: the first word of every message: "PlanOptions", or the entry point whose keywords
      these are (`pack_dataset`).
    seq_len, strategy, long_docs, max_segments_per_row, batch_size, pad_multiple: the fields.

  Raises:
    PipelineConfigError: naming the field and echoing its value.
  """
  if not_int(seq_len) or seq_len < 1:
    raise PipelineConfigError(f"{owner}: seq_len must be an int >= 1, got {seq_len!r}")
  valid = tuple(planner_lib.STRATEGIES)
  if not isinstance(strategy, str) or strategy not in valid:
    raise PipelineConfigError(
        f"{owner}: unknown strategy {strategy!r}; valid strategies: {', '.join(valid)}")
  _check_long_docs(owner, long_docs, seq_len)
  if max_segments_per_row is not None and (
      not_int(max_segments_per_row) or max_segments_per_row < 1):
    raise PipelineConfigError(
        f"{owner}: max_segments_per_row must be None or an int >= 1, got "
        f"{max_segments_per_row!r}")
  for name, value in (("batch_size", batch_size), ("pad_multiple", pad_multiple)):
    if not_int(value) or value < 1:
      raise PipelineConfigError(f"{owner}: {name} must be an int >= 1, got {value!r}")


def _check_long_docs(owner: str, long_docs: Any, seq_len: int) -> None:
  if not isinstance(long_docs, LongDocs):
    raise PipelineConfigError(
        f"{owner}: long_docs must be a segpack.LongDocs, got {long_docs!r}")
  if long_docs.mode not in LONG_DOC_MODES:
    raise PipelineConfigError(
        f"{owner}: long_docs.mode must be one of {', '.join(LONG_DOC_MODES)}, got "
        f"{long_docs.mode!r}")
  if not_int(long_docs.min_len) or long_docs.min_len < 0:
    raise PipelineConfigError(
        f"{owner}: long_docs.min_len must be an int >= 0, got {long_docs.min_len!r}")
  if not_int(long_docs.overlap) or not 0 <= long_docs.overlap < seq_len:
    raise PipelineConfigError(
        f"{owner}: long_docs.overlap must be an int in [0, seq_len) = [0, {seq_len}), "
        f"got {long_docs.overlap!r}")

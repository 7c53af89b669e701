"""The options of `pack_dataset`, `pack_minibatches` and `pack_pairs`: their groups, validation
and error type.

The groups are small frozen dataclasses, in the style of `grain.sharding.ShardOptions`:
`SpecialTokens` (BOS/EOS/padding ids), `PlanOptions` (the packing settings: `seq_len`, the
strategy, `LongDocs`, the segment cap; defined with the planner, `segpack.packing.options`) and
`LongDocs` (documents longer than a row; defined with the chunking rule,
`segpack.packing.chunking`). Which process owns which rows is `segpack.data.processes`'
(`process_index` and `process_count`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from segpack.errors import PipelineConfigError
from segpack.packing.chunking import DEFAULT_LONG_DOCS
from segpack.packing.options import PlanOptions, check_fields, not_int

__all__ = ["PipelineConfigError"]  # defined with the error base, where packing can raise it too


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """The token ids the row builder inserts.

  The row builder gets a resolved copy: ids as ints, taken from the source's tokenizer where
  None, and -1 where unused (`bos_id` without `add_bos`, `eos_id` without `add_eos`).

  Attributes:
    add_bos: slot 0 of every document's virtual sequence is `bos_id`.
    add_eos: the last slot of every document's virtual sequence is `eos_id`.
    bos_id: BOS token id; None: the source's tokenizer's (required when `add_bos`).
    eos_id: EOS token id; None: the source's tokenizer's (required when `add_eos`).
    pad_id: `input_ids` value on padding slots.
  """

  add_bos: bool = True
  add_eos: bool = True
  bos_id: int | None = None
  eos_id: int | None = None
  pad_id: int = 0

  @property
  def extra_tokens(self) -> int:
    """Slots every document adds to its tokens (its BOS and EOS)."""
    return int(bool(self.add_bos)) + int(bool(self.add_eos))


DEFAULT_SPECIAL_TOKENS = SpecialTokens()


def _not_bool(value: Any) -> bool:
  return not isinstance(value, (bool, np.bool_))


def plan_options(fn: str, plan: Any, *, seq_len: Any, strategy: Any = None,
                 long_docs: Any = None) -> PlanOptions:
  """The `PlanOptions` of an entry point: `plan`, or the one its keywords spell.

  The keywords are the short spelling of `plan=PlanOptions(seq_len=..., strategy=...,
  long_docs=...)`; None is a keyword not given (then the field's default), and the two
  spellings are refused together.

  Args:
    fn: the entry point's name, the first word of every message.
    plan: None, or a `PlanOptions`.
    seq_len, strategy, long_docs: the keywords (None: not given).

  Raises:
    PipelineConfigError: naming the argument or field and echoing its value.
  """
  given = [f"{name}={value!r}" for name, value in
           (("seq_len", seq_len), ("strategy", strategy), ("long_docs", long_docs))
           if value is not None]
  if plan is not None:
    if not isinstance(plan, PlanOptions):
      raise PipelineConfigError(f"{fn}: plan must be a segpack.PlanOptions, got plan={plan!r}")
    if given:
      raise PipelineConfigError(
          f"{fn}: pass the packing settings once, as plan=PlanOptions(...) or as keywords, "
          f"got plan={plan!r} and {', '.join(given)}")
    return plan
  if seq_len is None:
    raise PipelineConfigError(
        f"{fn}: needs seq_len=... (or plan=segpack.PlanOptions(seq_len=...)), got neither")
  strategy = "ffd" if strategy is None else strategy
  long_docs = DEFAULT_LONG_DOCS if long_docs is None else long_docs
  check_fields(fn, seq_len=seq_len, strategy=strategy, long_docs=long_docs)
  return PlanOptions(seq_len=seq_len, strategy=strategy, long_docs=long_docs)


def check_args(fn: str, *, plan: PlanOptions, seed: Any, num_epochs: Any,
               special_tokens: Any) -> None:
  """Validates the arguments every entry point shares (before any pass over the data).

  Args:
    fn: the entry point's name, the first word of every message.
    plan: the `PlanOptions` (from `plan_options`: its fields are checked already).
    seed: shuffling seed.
    num_epochs: None or the number of epochs.
    special_tokens: a `SpecialTokens`.

  Raises:
    PipelineConfigError: naming the argument and echoing its value.
  """
  if not_int(seed) or seed < 0:
    raise PipelineConfigError(f"{fn}: seed must be an int >= 0, got {seed!r}")
  if num_epochs is not None and (not_int(num_epochs) or num_epochs <= 0):
    raise PipelineConfigError(
        f"{fn}: num_epochs must be None (infinite) or a positive int, got {num_epochs!r}")
  _check_special_tokens(fn, special_tokens)
  extra = special_tokens.extra_tokens
  if plan.seq_len <= extra:
    raise PipelineConfigError(
        f"{fn}: seq_len={plan.seq_len} leaves no slot for a token next to the {extra} "
        f"BOS/EOS slot(s) of every document; use seq_len > {extra}")


def refuse_fields(fn: str, plan: PlanOptions, names: Sequence[str], *, why: str) -> None:
  """Refuses a `PlanOptions` field the entry point does not apply, unless at its default.

  Args:
    fn: the entry point's name.
    plan: its `PlanOptions`.
    names: the fields it does not apply.
    why: the reason, for the message.
  """
  defaults = PlanOptions(seq_len=plan.seq_len)
  for name in names:
    value, default = getattr(plan, name), getattr(defaults, name)
    if value != default:
      raise PipelineConfigError(
          f"{fn}: plan.{name}={value!r} does not apply ({why}); leave it at {default!r}")


def _check_special_tokens(fn: str, special: Any) -> None:
  if not isinstance(special, SpecialTokens):
    raise PipelineConfigError(
        f"{fn}: special_tokens must be a segpack.SpecialTokens, got {special!r}")
  for name in ("add_bos", "add_eos"):
    if _not_bool(getattr(special, name)):
      raise PipelineConfigError(
          f"{fn}: special_tokens.{name} must be a bool, got {getattr(special, name)!r}")
  for name in ("bos_id", "eos_id"):
    value = getattr(special, name)
    if value is not None and (not_int(value) or value < 0):
      raise PipelineConfigError(
          f"{fn}: special_tokens.{name} must be None or an int >= 0, got {value!r}")
  if not_int(special.pad_id) or special.pad_id < 0:
    raise PipelineConfigError(
        f"{fn}: special_tokens.pad_id must be an int >= 0, got {special.pad_id!r}")


def positive_or_none(fn: str, name: str, value: Any) -> None:
  if value is not None and (not_int(value) or value < 1):
    raise PipelineConfigError(f"{fn}: {name} must be None or an int >= 1, got {value!r}")

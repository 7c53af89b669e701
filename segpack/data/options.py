"""The options of `pack_dataset` and `pack_minibatches`: their groups, validation and error type.

The groups are small frozen dataclasses, in the style of `grain.sharding.ShardOptions`:
`SpecialTokens` (BOS/EOS/padding ids) and `LongDocs` (documents longer than a row; defined with
the chunking rule, `segpack.packing.chunking`). Which process
owns which rows is `segpack.data.processes`' (`process_index` and `process_count`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from segpack import packing
from segpack.errors import PipelineConfigError
from segpack.packing.chunking import LongDocs

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

def strategies() -> tuple[str, ...]:
  return tuple(packing.STRATEGIES)


def not_int(value: Any) -> bool:
  """True unless `value` is a Python or NumPy integer (a bool is not taken for one)."""
  return isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))


def _not_bool(value: Any) -> bool:
  return not isinstance(value, (bool, np.bool_))


def check_args(fn: str, *, seq_len: Any, strategy: Any, seed: Any, num_epochs: Any,
               special_tokens: Any, long_docs: Any) -> None:
  """Validates the arguments shared by both entry points (before any pass over the data).

  Args:
    fn: the entry point's name, the first word of every message.
    seq_len: slots per row.
    strategy: packer name.
    seed: shuffling seed.
    num_epochs: None or the number of epochs.
    special_tokens: a `SpecialTokens`.
    long_docs: a `LongDocs`.

  Raises:
    PipelineConfigError: naming the argument and echoing its value.
  """
  if not_int(seed) or seed < 0:
    raise PipelineConfigError(f"{fn}: seed must be an int >= 0, got {seed!r}")
  if not_int(seq_len):
    raise PipelineConfigError(f"{fn}: seq_len must be an int, got {seq_len!r}")
  valid = strategies()
  if strategy not in valid:
    raise PipelineConfigError(
        f"{fn}: unknown strategy {strategy!r}; valid strategies: {', '.join(valid)}")
  if num_epochs is not None and (not_int(num_epochs) or num_epochs <= 0):
    raise PipelineConfigError(
        f"{fn}: num_epochs must be None (infinite) or a positive int, got {num_epochs!r}")
  _check_special_tokens(fn, special_tokens)
  extra = special_tokens.extra_tokens
  if seq_len <= extra:
    raise PipelineConfigError(
        f"{fn}: seq_len={seq_len} leaves no slot for a token next to the {extra} "
        f"BOS/EOS slot(s) of every document; use seq_len > {extra}")
  _check_long_docs(fn, long_docs, seq_len)


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


def _check_long_docs(fn: str, long_docs: Any, seq_len: int) -> None:
  if not isinstance(long_docs, LongDocs):
    raise PipelineConfigError(f"{fn}: long_docs must be a segpack.LongDocs, got {long_docs!r}")
  if long_docs.mode not in packing.LONG_DOC_MODES:
    raise PipelineConfigError(
        f"{fn}: long_docs.mode must be one of {', '.join(packing.LONG_DOC_MODES)}, got "
        f"{long_docs.mode!r}")
  if not_int(long_docs.min_len) or long_docs.min_len < 0:
    raise PipelineConfigError(
        f"{fn}: long_docs.min_len must be an int >= 0, got {long_docs.min_len!r}")
  if not_int(long_docs.overlap) or not 0 <= long_docs.overlap < seq_len:
    raise PipelineConfigError(
        f"{fn}: long_docs.overlap must be an int in [0, seq_len) = [0, {seq_len}), "
        f"got {long_docs.overlap!r}")


def check_max_segments(fn: str, max_segments_per_row: Any) -> None:
  if max_segments_per_row is not None and (
      not_int(max_segments_per_row) or max_segments_per_row < 1):
    raise PipelineConfigError(
        f"{fn}: max_segments_per_row must be None or an int >= 1, got "
        f"{max_segments_per_row!r}")


def positive_or_none(fn: str, name: str, value: Any) -> None:
  if value is not None and (not_int(value) or value < 1):
    raise PipelineConfigError(f"{fn}: {name} must be None or an int >= 1, got {value!r}")

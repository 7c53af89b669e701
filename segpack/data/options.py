"""The options of `pack_dataset` and `pack_minibatches`: their groups, validation and error type.

The groups are small frozen dataclasses, in the style of `grain.sharding.ShardOptions`:
`SpecialTokens` (BOS/EOS/padding ids) and `LongDocs` (documents longer than a row). Process
sharding takes a `grain.sharding.ShardOptions` itself. `group_deprecated` maps the keyword names
of the previous release onto these groups, with a DeprecationWarning naming the replacement.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol
import warnings

import jax
import numpy as np

from segpack import packing


class PipelineConfigError(ValueError):
  """An argument of `pack_dataset` is invalid (the message names it and echoes the value)."""


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


@dataclasses.dataclass(frozen=True)
class LongDocs:
  """What happens to documents longer than a row, and which documents are dropped.

  Attributes:
    mode: "split" (chunks of `seq_len` slots, nothing dropped) or "truncate" (the first chunk
      only).
    overlap: slots a continuation chunk repeats from the previous chunk (no loss on them); in
      `[0, seq_len)`.
    min_len: documents with fewer tokens are dropped.
  """

  mode: str = "split"
  overlap: int = 0
  min_len: int = 0


class ShardOptionsLike(Protocol):
  """What `shard_options` must have: the fields of `grain.sharding.ShardOptions`."""

  shard_index: int
  shard_count: int
  drop_remainder: bool


@dataclasses.dataclass(frozen=True)
class _Shard:
  """Sharding given by the deprecated `shard_index` / `shard_count` keywords."""

  shard_index: int
  shard_count: int
  drop_remainder: bool = False


DEFAULT_SPECIAL_TOKENS = SpecialTokens()
DEFAULT_LONG_DOCS = LongDocs()

SPECIAL_TOKEN_NAMES = ("add_bos", "add_eos", "bos_id", "eos_id", "pad_id")
LONG_DOC_NAMES = ("overlap", "min_len")
SHARD_NAMES = ("shard_index", "shard_count")
MINIBATCH_NAMES = ("examples_per_batch", "tokens_per_batch", "rows_per_batch", "drop_remainder")


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
    strategy: planner name.
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
  if long_docs.mode not in packing.LONG_DOCS:
    raise PipelineConfigError(
        f"{fn}: long_docs.mode must be one of {', '.join(packing.LONG_DOCS)}, got "
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


def resolve_shard(fn: str, shard_options: ShardOptionsLike | None) -> tuple[int, int, bool]:
  """(shard_index, shard_count, drop_remainder); None: this JAX process of all of them."""
  if shard_options is None:
    return jax.process_index(), jax.process_count(), False
  try:
    index, count = shard_options.shard_index, shard_options.shard_count
    drop = shard_options.drop_remainder
  except AttributeError as e:
    raise PipelineConfigError(
        f"{fn}: shard_options must be a grain.sharding.ShardOptions (shard_index, shard_count, "
        f"drop_remainder), got {shard_options!r}") from e
  if not_int(count) or count < 1:
    raise PipelineConfigError(
        f"{fn}: shard_options.shard_count must be an int >= 1, got {count!r}")
  if not_int(index) or not 0 <= index < count:
    raise PipelineConfigError(
        f"{fn}: shard_options.shard_index must be an int in [0, {count}), got {index!r}")
  if _not_bool(drop):
    raise PipelineConfigError(
        f"{fn}: shard_options.drop_remainder must be a bool, got {drop!r}")
  return int(index), int(count), bool(drop)


def positive_or_none(fn: str, name: str, value: Any) -> None:
  if value is not None and (not_int(value) or value < 1):
    raise PipelineConfigError(f"{fn}: {name} must be None or an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Grouped:
  """The option groups after the deprecated keywords are folded in.

  Attributes:
    special_tokens: the `special_tokens` argument, or the one the old keywords spell.
    long_docs: likewise for `long_docs` (never a string).
    shard_options: likewise for `shard_options`.
    rest: deprecated keywords the caller handles itself (`passthrough`), by name.
  """

  special_tokens: SpecialTokens
  long_docs: LongDocs
  shard_options: ShardOptionsLike | None
  rest: dict[str, Any]


def deprecation(message: str, stacklevel: int) -> None:
  """Warns that a keyword is deprecated (`stacklevel`: as the caller would pass it to `warn`)."""
  warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def group_deprecated(fn: str, deprecated: dict[str, Any], *, special_tokens: Any,
                     long_docs: Any, shard_options: Any, passthrough: tuple[str, ...] = (),
                     stacklevel: int = 3) -> Grouped:
  """Folds the previous release's keywords into the option groups, warning for each.

  Args:
    fn: the entry point's name (for the messages).
    deprecated: the entry point's `**deprecated` keywords.
    special_tokens: its `special_tokens` argument (`DEFAULT_SPECIAL_TOKENS` when not passed).
    long_docs: its `long_docs` argument (`DEFAULT_LONG_DOCS` when not passed, or an old string).
    shard_options: its `shard_options` argument.
    passthrough: other deprecated names the entry point accepts and handles itself.
    stacklevel: the warnings' stack level as `warnings.warn` would take it here (3: the caller
      of the entry point).

  Returns:
    The groups, and the passthrough keywords that were given.

  Raises:
    TypeError: a keyword is not a parameter, old or new, of the entry point.
    PipelineConfigError: an old keyword and its new group are both given.
  """
  known = SPECIAL_TOKEN_NAMES + LONG_DOC_NAMES + SHARD_NAMES + passthrough
  unknown = sorted(set(deprecated) - set(known))
  if unknown:
    raise TypeError(f"{fn}() got unexpected keyword argument(s): {', '.join(unknown)}")
  level = stacklevel + 1
  return Grouped(
      special_tokens=_fold_special_tokens(fn, deprecated, special_tokens, level),
      long_docs=_fold_long_docs(fn, deprecated, long_docs, level),
      shard_options=_fold_shard(fn, deprecated, shard_options, level),
      rest={k: deprecated[k] for k in passthrough if k in deprecated})


def _spelled(values: dict[str, Any]) -> str:
  return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _fold_special_tokens(fn: str, deprecated: dict[str, Any], special: Any,
                         stacklevel: int) -> Any:
  old = {k: deprecated[k] for k in SPECIAL_TOKEN_NAMES if k in deprecated}
  if not old:
    return special
  if special is not DEFAULT_SPECIAL_TOKENS:
    raise PipelineConfigError(
        f"{fn}: got both {_spelled(old)} and special_tokens={special!r}; set "
        f"{', '.join(old)} inside special_tokens")
  for name in ("add_bos", "add_eos"):
    if name in old:
      old[name] = bool(old[name])  # The old keywords took any truthy value.
  deprecation(f"{fn}: the keyword(s) {', '.join(old)} are deprecated; pass "
              f"special_tokens=segpack.SpecialTokens({_spelled(old)})", stacklevel)
  return dataclasses.replace(DEFAULT_SPECIAL_TOKENS, **old)


def _fold_long_docs(fn: str, deprecated: dict[str, Any], long_docs: Any,
                    stacklevel: int) -> Any:
  old = {k: deprecated[k] for k in LONG_DOC_NAMES if k in deprecated}
  if isinstance(long_docs, str):
    old = {"mode": long_docs, **old}
  elif old and long_docs is not DEFAULT_LONG_DOCS:
    raise PipelineConfigError(
        f"{fn}: got both {_spelled(old)} and long_docs={long_docs!r}; set "
        f"{', '.join(old)} inside long_docs")
  if not old:
    return long_docs
  names = ", ".join("long_docs as a string" if k == "mode" else k for k in old)
  verb = "is" if len(old) == 1 else "are"
  deprecation(f"{fn}: {names} {verb} deprecated; pass long_docs=segpack.LongDocs({_spelled(old)})",
              stacklevel)
  return dataclasses.replace(DEFAULT_LONG_DOCS, **old)


def _fold_shard(fn: str, deprecated: dict[str, Any], shard_options: Any,
                stacklevel: int) -> Any:
  old = {k: deprecated[k] for k in SHARD_NAMES if k in deprecated}
  if not old:
    return shard_options
  given = {k: v for k, v in old.items() if v is not None}
  if given and shard_options is not None:
    raise PipelineConfigError(
        f"{fn}: got both {_spelled(given)} and shard_options={shard_options!r}; pass "
        f"shard_options only")
  deprecation(f"{fn}: the keyword(s) {', '.join(old)} are deprecated; pass shard_options="
              f"grain.sharding.ShardOptions({_spelled(old)})", stacklevel)
  if not given:
    return shard_options  # None for both meant "this JAX process", as shard_options=None does.
  index, count = old.get("shard_index"), old.get("shard_count")
  if index is None or count is None:
    raise PipelineConfigError(
        f"{fn}: give both shard_index and shard_count, got shard_index={index!r}, "
        f"shard_count={count!r}")
  if not_int(count) or count < 1:
    raise PipelineConfigError(f"{fn}: shard_count must be an int >= 1, got {count!r}")
  if not_int(index) or not 0 <= index < count:
    raise PipelineConfigError(f"{fn}: shard_index must be in [0, {count}), got {index!r}")
  return _Shard(shard_index=int(index), shard_count=int(count))

"""The options of `pack_dataset`, their validation, and its error type."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from segpack import packing


class PipelineConfigError(ValueError):
  """An argument of `pack_dataset` is invalid (the message names it and echoes the value)."""


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


def strategies() -> tuple[str, ...]:
  return tuple(packing.STRATEGIES)


def not_int(value: Any) -> bool:
  """True unless `value` is a Python or NumPy integer (a bool is not taken for one)."""
  return isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))


def check_args(*, seq_len, strategy, long_docs, min_len, overlap, extra, num_epochs,
                max_segments_per_row, seed) -> None:
  """Validates the scalar arguments of `pack_dataset` (before any pass over the data)."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise PipelineConfigError(f"pack_dataset: seed must be an int >= 0, got {seed!r}")
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)):
    raise PipelineConfigError(f"pack_dataset: seq_len must be an int, got {seq_len!r}")
  if seq_len <= extra:
    raise PipelineConfigError(
        f"pack_dataset: seq_len={seq_len} leaves no slot for a token next to the {extra} "
        f"BOS/EOS slot(s) of every document; use seq_len > {extra}")
  valid = strategies()
  if strategy not in valid:
    raise PipelineConfigError(
        f"pack_dataset: unknown strategy {strategy!r}; valid strategies: {', '.join(valid)}")
  if long_docs not in packing.LONG_DOCS:
    raise PipelineConfigError(
        f"pack_dataset: unknown long_docs {long_docs!r}; valid: {', '.join(packing.LONG_DOCS)}")
  if not_int(min_len) or min_len < 0:
    raise PipelineConfigError(f"pack_dataset: min_len must be an int >= 0, got {min_len!r}")
  if not_int(overlap) or not 0 <= overlap < seq_len:
    raise PipelineConfigError(
        f"pack_dataset: overlap must be an int in [0, seq_len) = [0, {seq_len}), "
        f"got {overlap!r}")
  if num_epochs is not None and (not_int(num_epochs) or num_epochs <= 0):
    raise PipelineConfigError(
        f"pack_dataset: num_epochs must be None (infinite) or a positive int, got {num_epochs!r}")
  if max_segments_per_row is not None and (
      not_int(max_segments_per_row) or max_segments_per_row < 1):
    raise PipelineConfigError(
        f"pack_dataset: max_segments_per_row must be None or an int >= 1, got "
        f"{max_segments_per_row!r}")


def resolve_shard(shard_index: int | None, shard_count: int | None,
           shard_options: Any) -> tuple[int, int, bool]:
  """Resolves (shard_index, shard_count, drop_remainder); defaults to the JAX process."""
  if shard_options is not None:
    if shard_index is not None or shard_count is not None:
      raise PipelineConfigError(
          "pack_dataset: pass either shard_options or shard_index/shard_count, not both")
    return (int(shard_options.shard_index), int(shard_options.shard_count),
            bool(shard_options.drop_remainder))
  if shard_index is None and shard_count is None:
    return jax.process_index(), jax.process_count(), False
  if shard_index is None or shard_count is None:
    raise PipelineConfigError(
        f"pack_dataset: give both shard_index and shard_count, got shard_index={shard_index!r}, "
        f"shard_count={shard_count!r}")
  if not isinstance(shard_count, (int, np.integer)) or shard_count < 1:
    raise PipelineConfigError(f"pack_dataset: shard_count must be an int >= 1, got {shard_count!r}")
  if not isinstance(shard_index, (int, np.integer)) or not 0 <= shard_index < shard_count:
    raise PipelineConfigError(
        f"pack_dataset: shard_index must be in [0, {shard_count}), got {shard_index!r}")
  return int(shard_index), int(shard_count), False


def positive_or_none(name: str, value: Any) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                            or value < 1):
    raise PipelineConfigError(f"pack_dataset: {name} must be None or an int >= 1, got {value!r}")

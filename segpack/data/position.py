"""Where a batch iterator stands: one position and one iterator-state format for both streams.

Both batch streams are epochs of units: the row stream (`StreamBatches`, unit `"rows"`: row
`index` of epoch `epoch`'s permutation) and the minibatch steps (`pack_minibatches`, unit
`"steps"`: optimizer step `index` of epoch `epoch`). `StreamIterator` walks either one, and its
state is version 1 of one format,

    {"version": 1, "unit": "rows" | "steps", "epoch": e, "index": i, "epoch_length": n}

where `n` is the units of epoch `e` (checked on load, so that a state of other data is refused).
The position names no process and no batch size, so a state saved by `P` processes resumes on
`Q`. Any other state (an older segpack's `{"epoch", "index", "rows_per_epoch"}`, Grain's
`{"next_index": k}`) is refused with one `StreamStateError` line.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import grain
import numpy as np

from segpack.errors import UserError

__all__ = ["STATE_KEYS", "STATE_VERSION", "UNITS", "PositionedBatches", "StreamIterator",
           "StreamPosition", "StreamStateError", "read_state"]

STATE_VERSION = 1
STATE_KEYS = ("version", "unit", "epoch", "index", "epoch_length")
UNITS = ("rows", "steps")


class StreamStateError(UserError, ValueError):
  """An iterator state cannot be restored here; the message names the field and its value."""


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def read_state(state: Any) -> tuple[str, "StreamPosition", int]:
  """`(unit, position, epoch_length)` of a version-1 state, checked for its form only.

  Raises:
    StreamStateError: it is not a version-1 state (an older format, a missing or extra key, a
      value of the wrong type); the message names the key and echoes the value.
  """
  if not isinstance(state, dict):
    raise StreamStateError(f"iterator state must be a dict, got {state!r}")
  if "version" not in state:
    raise StreamStateError(
        f"iterator state {state!r} has no 'version': it is of an older format; this version "
        f"reads version {STATE_VERSION}, {{{', '.join(STATE_KEYS)}}}, only")
  if not _is_int(state["version"]) or state["version"] != STATE_VERSION:
    raise StreamStateError(f"iterator state has version={state['version']!r}; this version "
                           f"reads version {STATE_VERSION} only")
  if set(state) != set(STATE_KEYS):
    raise StreamStateError(
        f"iterator state must have exactly the keys {', '.join(STATE_KEYS)}, got "
        f"{', '.join(sorted(map(str, state)))}")
  unit, epoch, index, length = (state[k] for k in STATE_KEYS[1:])
  if unit not in UNITS:
    raise StreamStateError(f"iterator state has unit={unit!r}, not one of {', '.join(UNITS)}")
  for name, value, least in (("epoch", epoch, 0), ("index", index, 0),
                             ("epoch_length", length, 1)):
    if not _is_int(value) or value < least:
      raise StreamStateError(
          f"iterator state: {name} must be an int >= {least}, got {name}={value!r}")
  return unit, StreamPosition(epoch=int(epoch), index=int(index)), int(length)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamPosition:
  """A position in a batch stream: unit `index` (a row, or a step) of epoch `epoch`.

  Attributes:
    epoch: the epoch (0, 1, ...).
    index: the unit within the epoch, `0 <= index <` the epoch's units.
  """

  epoch: int
  index: int

  def to_state(self, *, unit: str, epoch_length: int) -> dict[str, Any]:
    """The iterator state, `{"version": 1, "unit", "epoch", "index", "epoch_length"}`.

    Args:
      unit: "rows" or "steps", what `index` counts.
      epoch_length: the units of epoch `epoch` (checked when the state is read back).
    """
    return {"version": STATE_VERSION, "unit": unit, "epoch": int(self.epoch),
            "index": int(self.index), "epoch_length": int(epoch_length)}

  @classmethod
  def from_state(cls, state: Any, *, unit: str,
                 epoch_length: Callable[[int], int]) -> "StreamPosition":
    """Reads `to_state`'s dict for a stream of `unit`s whose epoch `e` has `epoch_length(e)`.

    Raises:
      StreamStateError: `read_state` refuses it, it counts another unit, its epoch has another
        length here (other data or packing), or its index lies outside its epoch.
    """
    saved_unit, position, saved_length = read_state(state)
    if saved_unit != unit:
      raise StreamStateError(
          f"iterator state has unit={saved_unit!r}, but this iterator counts {unit!r}: it is a "
          f"state of the other stream ({_STREAMS[saved_unit]}, not {_STREAMS[unit]})")
    length = int(epoch_length(position.epoch))
    if saved_length != length:
      raise StreamStateError(
          f"iterator state has epoch_length={saved_length}, but epoch {position.epoch} of this "
          f"data set has {length} {unit}: the data or the packing changed since it was saved")
    if position.index >= length:
      raise StreamStateError(
          f"iterator state needs 0 <= index < {length} (the {unit} of epoch {position.epoch}), "
          f"got index={position.index}")
    return position


_STREAMS = {"rows": "StreamBatches", "steps": "pack_minibatches"}


class PositionedBatches(Protocol):
  """What `StreamIterator` walks: batches whose element `k` starts at `position(k)`."""

  @property
  def unit(self) -> str:
    """"rows" or "steps": what a position's index counts."""

  def epoch_length(self, epoch: int) -> int:
    """The units of epoch `epoch`."""

  def position(self, k: int) -> StreamPosition:
    """Where element `k` starts."""

  def starting_at(self, start: StreamPosition) -> "PositionedBatches":
    """The same batches' layout, element 0 starting at `start`."""

  def plan_rows(self, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`(epoch, plan row)` of each of this process's rows of element `k`."""

  def to_iter_dataset(self, read_options: grain.ReadOptions) -> grain.IterDataset:
    """Grain's iterable view, prefetched with `read_options`."""


class StreamIterator(grain.DatasetIterator):
  """Iterates `StreamBatches` or `pack_minibatches` steps; its state is the next batch's position.

  Algorithm:
    1. `next` reads element `c` (the `c`-th since the start) through Grain's prefetching view
       (`read_options`), and counts it.
    2. `get_state` is `position(c).to_state(...)`: the position where the next batch starts,
       the same on every process and independent of the process count (and, for rows, of the
       batch size).
    3. `set_state` reads such a state (`StreamPosition.from_state`, checked against this data)
       and restarts the batches there with the iterator's own layout (`starting_at`).

  Example: a row stream of 5 rows per epoch in global batches of 4: after two batches the state
  is `{"version": 1, "unit": "rows", "epoch": 1, "index": 3, "epoch_length": 5}`, and an
  iterator of any process count set to it continues with row 3 of epoch 1's permutation.
  """

  def __init__(self, batches: PositionedBatches, *,
               read_options: grain.ReadOptions | None = None):
    super().__init__()
    self._batches = batches
    self._read_options = read_options
    self._consumed = 0
    self._inner = None

  def __next__(self) -> dict[str, np.ndarray]:
    if self._inner is None:
      dataset = self._batches.to_iter_dataset(self._read_options or grain.ReadOptions())
      self._inner = iter(dataset)
    batch = next(self._inner)
    self._consumed += 1
    return batch

  @property
  def last_plan_rows(self) -> tuple[np.ndarray, np.ndarray] | None:
    """`plan_rows` of the batch `next` returned last (None before the first)."""
    if not self._consumed:
      return None
    return self._batches.plan_rows(self._consumed - 1)

  def position(self) -> StreamPosition:
    """Where the next batch starts."""
    return self._batches.position(self._consumed)

  def get_state(self) -> dict[str, Any]:
    position = self.position()
    return position.to_state(unit=self._batches.unit,
                             epoch_length=self._batches.epoch_length(position.epoch))

  def set_state(self, state: dict[str, Any]) -> None:
    start = StreamPosition.from_state(state, unit=self._batches.unit,
                                      epoch_length=self._batches.epoch_length)
    self._batches = self._batches.starting_at(start)
    self._consumed = 0
    self._inner = None

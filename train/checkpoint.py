"""Atomic, resumable checkpoints of the train state, the data position and the config (orbax).

A checkpoint `WORKDIR/checkpoints/<step>/` holds three items:
  * `state`: parameters, optimizer state and step (`StandardSave`; restored straight into the
    target shardings, so a changed mesh reshards on load);
  * `data`: the position of the training data, one value for all processes (`JsonSave`):
    `{"format": 2, "iterator": STATE, "process_count": Q}`, where `STATE` is the stream position
    `{"epoch", "index", "rows_per_epoch"}` (global packing) or Grain's `{"next_index": k}`
    (minibatch packing); neither depends on the process count, so a run resumes on another one.
    A data item of another format is refused with a `DataStateError`;
  * `meta`: the config that wrote it (`JsonSave`), compared with the current config on resume.
Orbax writes into a temporary directory and renames it when complete, so a `kill -9` during a save
leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

# Config keys that may change between a run and its resumption (they do not change the math of
# the steps already taken or the batches still to come).
RESUMABLE_CHANGES = frozenset({
    "train.num_steps", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.checkpoint_every", "train.max_checkpoints", "train.log_batches", "mesh.data",
    "mesh.fsdp", "mesh.tensor", "attention.implementation", "attention.interpret",
    "attention.self_check", "train.peak_flops", "data.cache_dir", "train.allow_batch_size_change",
})
# Resumable only when the current config says `train.allow_batch_size_change=True`: the data
# position is a row of the stream, so the next steps simply take another number of rows.
BATCH_SIZE_KEY = "train.batch_size"
DATA_FORMAT = 2
# `loss.weighting` is deliberately not resumable: it changes the objective being optimised.


class IncompatibleCheckpointError(ValueError):
  """The checkpoint in the workdir was written by a config that differs in a way that matters."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """`{"a": {"b": 1}}` -> `{"a.b": 1}` (for config comparison)."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def config_differences(saved: dict[str, Any], current: dict[str, Any], *,
                       also_resumable: frozenset[str] = frozenset()) -> list[str]:
  """Lines `key: checkpoint has X, config has Y` for every difference outside RESUMABLE_CHANGES
  and `also_resumable`."""
  a, b = flatten(saved), flatten(current)
  lines = []
  for key in sorted(set(a) | set(b)):
    if key in RESUMABLE_CHANGES or key in also_resumable:
      continue
    if a.get(key, "<absent>") != b.get(key, "<absent>"):
      lines.append(f"{key}: checkpoint has {a.get(key, '<absent>')!r}, "
                   f"config has {b.get(key, '<absent>')!r}")
  return lines


class DataStateError(ValueError):
  """The checkpoint's data position cannot be restored (or the processes disagree on it)."""


@dataclasses.dataclass
class Restored:
  """What `Checkpointer.restore_or_none` found.

  Attributes:
    state: the train state, in the target shardings.
    data_state: the training iterator's state (the same on every process).
    step: the checkpoint's step.
    changes: lines for the log, what differs from the run that wrote it (process count, batch
      size), empty when nothing does.
  """

  state: Any
  data_state: dict[str, Any]
  step: int
  changes: list[str]


class Checkpointer:
  """Saves every `every` steps (and on demand) and restores the latest checkpoint.

  Algorithm:
    1. `restore_or_none(abstract_state, config_dict)`: if a committed checkpoint exists, compare its
       `meta` config with `config_dict` (refuse with the differing keys; `train.batch_size` may
       differ when `config_dict` has `train.allow_batch_size_change=True`), then restore `state`
       into the abstract target's shardings and return it with the data iterator state.
    2. `maybe_save(step, ...)`: save when `step % every == 0`, or when forced (the last step);
       the processes' data states are gathered and must agree.
    3. Old checkpoints beyond `max_to_keep` are deleted by orbax after a successful save.

  Example: `every=100`, killed at step 250: the rerun restores step 200 and the data position
  saved with it, so it trains on batches 201, 202, ... exactly as the first run did (on another
  process count, on the same rows of the stream).
  """

  def __init__(self, directory: str | os.PathLike, *, every: int, max_to_keep: int):
    self.directory = os.path.abspath(os.fspath(directory))
    self.every = every
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "data", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore_or_none(self, abstract_state: Any,
                      config_dict: dict[str, Any]) -> Restored | None:
    """Returns the latest checkpoint as a `Restored`, or None.

    Args:
      abstract_state: the state's shapes and target shardings.
      config_dict: this run's config.

    Raises:
      IncompatibleCheckpointError: the checkpoint's config differs from `config_dict`.
      DataStateError: its data item is not of format `DATA_FORMAT`.
    """
    step = self._manager.latest_step()
    if step is None:
      return None
    where = f"{self.directory}/{step}"
    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    saved = meta["meta"]["config"]
    allow = bool(flatten(config_dict).get("train.allow_batch_size_change", False))
    diffs = config_differences(saved, config_dict,
                               also_resumable=frozenset({BATCH_SIZE_KEY} if allow else ()))
    if diffs:
      hint = ("" if allow or not any(d.startswith(BATCH_SIZE_KEY + ":") for d in diffs) else
              "; to resume with another train.batch_size, set "
              "--config.train.allow_batch_size_change=True")
      raise IncompatibleCheckpointError(
          f"cannot resume from {where}: its config differs from this run's:\n  "
          + "\n  ".join(diffs) + f"\n(use a new --workdir, or the same config{hint})")
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    item = restored["data"]
    old_batch = flatten(saved)[BATCH_SIZE_KEY]
    if item.get("format") != DATA_FORMAT:
      raise DataStateError(
          f"cannot resume from {where}: its data item has format {item.get('format')!r}, this "
          f"version reads format {DATA_FORMAT} only; start a new --workdir")
    data_state, old_count = item["iterator"], int(item["process_count"])
    changes = []
    if old_count != jax.process_count():
      changes.append(f"processes: {old_count} -> {jax.process_count()}")
    new_batch = flatten(config_dict)[BATCH_SIZE_KEY]
    if old_batch != new_batch:
      changes.append(f"train.batch_size: {old_batch} -> {new_batch}")
    return Restored(state=restored["state"], data_state=data_state, step=step, changes=changes)

  def maybe_save(self, step: int, state: Any, data_state: dict[str, Any],
                 config_dict: dict[str, Any], *, force: bool = False) -> bool:
    """Saves if `step` is a multiple of `every` (or `force`); returns whether it saved.

    `data_state` is this process's iterator state; it must be the same on every process (a
    position in the global stream), checked by gathering them.

    Raises:
      DataStateError: the processes' data states differ.
    """
    if not force and (self.every <= 0 or step % self.every):
      return False
    if self._manager.latest_step() == step:
      return False
    states = _gather_json(data_state)
    if any(other != data_state for other in states.values()):
      raise DataStateError(
          f"step {step}: the processes' data positions differ, so no single position can be "
          f"saved: {states}")
    item = {"format": DATA_FORMAT, "iterator": data_state, "process_count": len(states)}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(item),
        meta=ocp.args.JsonSave({"config": config_dict, "step": step})), force=True)
    self._manager.wait_until_finished()
    return True

  def close(self) -> None:
    self._manager.close()


def _gather_json(value: dict[str, Any]) -> dict[str, Any]:
  """`{str(process_index): value}` over all processes (a single process needs no collective)."""
  if jax.process_count() == 1:
    return {"0": value}
  encoded = json.dumps(value).encode()
  size = int(np.max(multihost_utils.process_allgather(np.int32(len(encoded)))))
  buf = np.zeros(size, np.uint8)
  buf[:len(encoded)] = np.frombuffer(encoded, np.uint8)
  gathered = multihost_utils.process_allgather(buf)
  return {str(i): json.loads(bytes(row).rstrip(b"\0").decode()) for i, row in enumerate(gathered)}

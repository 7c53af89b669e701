"""Atomic, resumable checkpoints of the train state, the data position and the config (orbax).

A checkpoint `WORKDIR/checkpoints/<step>/` holds three items:
  * `state`: parameters, optimizer state and step (`StandardSave`; restored straight into the
    target shardings, so a changed mesh reshards on load);
  * `data`: the Grain iterator state of this process's training batches (`JsonSave`);
  * `meta`: the config that wrote it (`JsonSave`), compared with the current config on resume.
Orbax writes into a temporary directory and renames it when complete, so a `kill -9` during a save
leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

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
    "attention.self_check", "train.peak_flops", "data.cache_dir",
})
# `loss.weighting` is deliberately not resumable: it changes the objective being optimised.

# Keys added to the config after checkpoints were written without them: an absent key reads as
# this value, the behaviour those checkpoints were trained with.
DEFAULTS_OF_ADDED_KEYS = {"loss.weighting": "token", "packing.balance": "none"}


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


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """Lines `key: checkpoint has X, config has Y` for every difference outside RESUMABLE_CHANGES."""
  a, b = flatten(saved), flatten(current)
  for key, value in DEFAULTS_OF_ADDED_KEYS.items():
    a.setdefault(key, value)
    b.setdefault(key, value)
  lines = []
  for key in sorted(set(a) | set(b)):
    if key in RESUMABLE_CHANGES:
      continue
    if a.get(key, "<absent>") != b.get(key, "<absent>"):
      lines.append(f"{key}: checkpoint has {a.get(key, '<absent>')!r}, "
                   f"config has {b.get(key, '<absent>')!r}")
  return lines


class Checkpointer:
  """Saves every `every` steps (and on demand) and restores the latest checkpoint.

  Algorithm:
    1. `restore_or_none(abstract_state, config_dict)`: if a committed checkpoint exists, compare its
       `meta` config with `config_dict` (refuse with the differing keys), then restore `state`
       into the abstract target's shardings and return it with the data iterator state.
    2. `maybe_save(step, ...)`: save when `step % every == 0`, or when forced (the last step).
    3. Old checkpoints beyond `max_to_keep` are deleted by orbax after a successful save.

  Example: `every=100`, killed at step 250: the rerun restores step 200 and the data iterator
  state saved with it, so it trains on batches 201, 202, ... exactly as the first run did.
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

  def restore_or_none(self, abstract_state: Any, config_dict: dict[str, Any]
                      ) -> tuple[Any, dict[str, Any], int] | None:
    """Returns `(state, data_iterator_state, step)` of the latest checkpoint, or None.

    Raises:
      IncompatibleCheckpointError: the checkpoint's config differs from `config_dict`, or it was
        written by a different number of processes (whose data positions do not map onto ours).
    """
    step = self._manager.latest_step()
    if step is None:
      return None
    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    diffs = config_differences(meta["meta"]["config"], config_dict)
    if diffs:
      raise IncompatibleCheckpointError(
          f"cannot resume from {self.directory}/{step}: its config differs from this run's:\n  "
          + "\n  ".join(diffs) + "\n(use a new --workdir, or the same config)")
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    data_state = restored["data"].get(str(jax.process_index()))
    if data_state is None or len(restored["data"]) != jax.process_count():
      raise IncompatibleCheckpointError(
          f"cannot resume from {self.directory}/{step}: it holds the data positions of "
          f"{len(restored['data'])} processes, this run has {jax.process_count()}")
    return restored["state"], data_state, step

  def maybe_save(self, step: int, state: Any, data_state: dict[str, Any],
                 config_dict: dict[str, Any], *, force: bool = False) -> bool:
    """Saves if `step` is a multiple of `every` (or `force`); returns whether it saved.

    `data_state` is this process's iterator state; every process's state is gathered into the
    `data` item so a multi-host run restores each process's own position.
    """
    if not force and (self.every <= 0 or step % self.every):
      return False
    if self._manager.latest_step() == step:
      return False
    states = _gather_json(data_state)
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(states),
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

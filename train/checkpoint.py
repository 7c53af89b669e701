"""Atomic, resumable checkpoints of the train state, the data position and the config (orbax).

A checkpoint `WORKDIR/checkpoints/<step>/` holds three items:
  * `state`: parameters, optimizer state and step (`StandardSave`; restored straight into the
    target shardings, so a changed mesh reshards on load);
  * `data`: the position of the training data, one value for all processes (`JsonSave`):
    `{"format": 3, "iterator": STATE, "process_count": Q}`, `STATE` the iterator state of
    `segpack.data.position` (`{"version": 1, "unit", "epoch", "index", "epoch_length"}`, in rows
    or minibatch steps), which does not depend on the process count, so a run resumes on another
    one. Checked on save and restore (`train.checkpoint_compat.check_data_item`): another
    format is a `DataStateError`;
  * `meta`: the config that wrote it (`JsonSave`), compared with the current config on resume,
    and under adapters the frozen base's fingerprint (`train.adapters.base`), which must match.
Orbax writes into a temporary directory and renames it when complete, so a `kill -9` during a save
leaves the previous checkpoint as the latest one. Then `digest.json` records the sha256 of every
file (`train.checkpoint_digest`); a restore checks it first and falls back to the newest intact
checkpoint, or refuses with `DamagedCheckpointError` when there is none. The directory must be
writable when the run starts, and a save the disk refuses (full, read-only) stops the run with
one `CheckpointWriteError` line naming the directory and its free space.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from segpack import errors
from train import checkpoint_digest as digest_lib
from train.checkpoint_compat import BATCH_SIZE_KEY, DATA_FORMAT, DataStateError
from train.checkpoint_compat import IncompatibleCheckpointError, check_data_item
from train.checkpoint_compat import config_differences, flatten
from train.checkpoint_digest import CheckpointWriteError, DamagedCheckpointError


@dataclasses.dataclass
class Restored:
  """What `Checkpointer.restore_or_none` found: the train state (in the target shardings), the
  iterator's state (the same on every process), the step, and lines for the log of what differs
  from the run that wrote it (process count, batch size; empty when nothing does)."""

  state: Any
  data_state: dict[str, Any]
  step: int
  changes: list[str]


class Checkpointer:
  """Saves every `every` steps (and on demand), verifies and restores the latest checkpoint.

  Algorithm:
    0. `__init__`: create the directory and write a byte into it (`check_writable`): a read-only
       or full one is a `CheckpointWriteError` before the first step.
    1. `restore_or_none(abstract_state, config_dict)`: list the directory (`checkpoint_digest.
       scan`; odd names skipped with a warning, orbax's unfinished saves removed) and check the
       steps newest first against their digests (sha256 of every file). A damaged one is moved
       to `<workdir>/damaged_checkpoints/` with a warning; none intact is a
       `DamagedCheckpointError` (never a silent fresh start). Then compare its `meta` (config
       keys, `train.batch_size` only with `train.allow_batch_size_change=True`; the base) and
       restore `state` into the abstract target's shardings with the data iterator state.
    2. `maybe_save(step, ...)`: save when `step % every == 0`, or when forced (the last step);
       the processes' data states are gathered and must agree. Orbax saves synchronously
       (`enable_async_checkpointing=False`, then `wait_until_finished`), so the files are final
       when process 0 hashes them and writes `digest.json`; that checkpoint is then verified.
       A save that fails for the disk (`checkpoint_digest.write_errno`) removes what it wrote
       and raises `CheckpointWriteError` (the directory, its free space, the checkpoint kept).
    3. Rotation (ours, not orbax's): keep the `max_to_keep` newest checkpoints and, always, the
       newest verified one (a checkpoint whose digest could not be recorded is not verified).

  Example: `every=100`, killed at step 250: the rerun restores step 200 and its data position,
  so it trains on batches 201, 202, ... as the first run did (on any process count). Had a
  byte of step 200 changed on disk, it warns, moves 200 aside and restores step 100.
  """

  def __init__(self, directory: str | os.PathLike, *, every: int, max_to_keep: int,
               base: str | None = None):
    self.directory = os.path.abspath(os.fspath(directory))
    self.every = every
    self.max_to_keep = max_to_keep
    self.base = base  # the frozen base's fingerprint under adapters (`meta`), else None
    self._verified: set[int] = set()  # saved with a recorded digest, or checked on restore
    if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
      raise DamagedCheckpointError(
          f"{self.directory} is not a directory: the workdir's checkpoints go there (move that "
          "file away, or use another --workdir)")
    digest_lib.check_writable(self.directory)
    self._orbax: ocp.CheckpointManager | None = None  # made after the restore's checks

  @property
  def _manager(self) -> ocp.CheckpointManager:
    """Orbax's manager, made on first use: after `restore_or_none` has moved damaged checkpoints
    away (orbax lists, and logs about, every step directory when it starts)."""
    if self._orbax is None:
      options = ocp.CheckpointManagerOptions(
          max_to_keep=None, create=True, enable_async_checkpointing=False)
      self._orbax = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "data", "meta"))
    return self._orbax

  def latest_step(self) -> int | None:
    """The newest verified checkpoint's step (the one a rerun resumes from), or None."""
    return max(self._verified) if self._verified else None

  def _choose_step(self) -> int | None:
    """The newest intact checkpoint's step after quarantining the damaged newer ones, and the
    older step entries that are no directory (a file, a link); all processes agree: process 0
    checks and decides. None when there is no checkpoint.

    Raises:
      DamagedCheckpointError: checkpoints exist and none is intact, or a damaged one cannot be
        moved aside.
    """
    listing, chosen, damaged = digest_lib.scan(self.directory), None, []
    if jax.process_index() == 0:
      for step in listing.steps:
        path = os.path.join(self.directory, str(step))
        if chosen is not None:  # older: only a link or a file is moved aside (orbax trips on it)
          bad = digest_lib.problem(path, step) if not _plain_directory(path) else None
        else:
          bad = digest_lib.problem(path, step)
          chosen = step if bad is None else None
        if bad is not None:
          damaged.append((step, " ".join(bad.split())))
    if jax.process_count() > 1:
      chosen = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if chosen is None else
                                                                 chosen)))
      chosen = None if chosen < 0 else chosen
    if chosen is None and listing.steps:  # the one line says it all: no warnings before it
      found = "; ".join(f"{s}: {why}" for s, why in damaged) or "process 0 found none"
      raise DamagedCheckpointError(
          f"no intact checkpoint in {self.directory} ({found}); move the damaged ones away (or use "
          "a new --workdir) to train from scratch")
    if jax.process_index() == 0:
      self._tidy(listing, damaged, chosen)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoint quarantine")
    if self._orbax is not None:
      self._orbax.reload()
    return chosen

  def _tidy(self, listing: digest_lib.Listing, damaged: list[tuple[int, str]],
            chosen: int | None) -> None:
    """Process 0, before orbax lists the directory: names the entries that are no checkpoint
    (left in place), removes orbax's unfinished saves and moves the damaged checkpoints to
    `damaged_checkpoints/`, each in a warning."""
    skipped = listing.skipped_line()
    if skipped:
      logging.warning("%s", skipped)
    if listing.unfinished:
      failed = digest_lib.remove_unfinished(self.directory, listing.unfinished)
      logging.warning("%s: removed %s, orbax's temporary directories of saves that did not finish"
                      "%s", self.directory, ", ".join(listing.unfinished),
                      f" (could not remove {', '.join(failed)})" if failed else "")
    moved = [self._quarantine(step, bad) for step, bad in damaged]
    if any(step > chosen for step, _ in damaged):
      logging.warning("resuming from the newest intact checkpoint %s/%d instead; the damaged "
                      "one(s) moved to %s", self.directory, chosen, ", ".join(moved))
    elif moved:
      logging.warning("resuming from %s/%d; older entries that are no checkpoint directory moved "
                      "to %s", self.directory, chosen, ", ".join(moved))

  def _quarantine(self, step: int, bad: str) -> str:
    """Moves the damaged checkpoint `step` (a directory, a file or a link) to
    `checkpoint_digest.quarantine_path`, warning with `bad`; returns where it went.

    Raises:
      DamagedCheckpointError: it cannot be moved (one line naming both paths).
    """
    logging.warning("checkpoint %s/%d is damaged: %s", self.directory, step, bad)
    source = os.path.join(self.directory, str(step))
    target = digest_lib.quarantine_path(self.directory, step)
    try:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.move(source, target)
    except OSError as e:
      raise DamagedCheckpointError(
          f"cannot move the damaged checkpoint {source} to {target} ({e.strerror or e}): move it "
          f"out of {self.directory} yourself (or use a new --workdir)") from e
    return target

  def restore_or_none(self, abstract_state: Any,
                      config_dict: dict[str, Any]) -> Restored | None:
    """Returns the newest intact checkpoint as a `Restored`, or None when there is none.

    Args:
      abstract_state: the state's shapes and target shardings.
      config_dict: this run's config.

    Raises:
      DamagedCheckpointError: checkpoints exist and none matches its digest, or orbax cannot
        read the one that does.
      IncompatibleCheckpointError: the checkpoint's config differs from `config_dict`.
      DataStateError: its data item is not of format `DATA_FORMAT` with a version-1 state.
    """
    step = self._choose_step()
    if step is None:
      return None
    where = f"{self.directory}/{step}"
    meta = self._read(where, step, ocp.args.Composite(meta=ocp.args.JsonRestore()))
    saved = meta["meta"]["config"]
    if meta["meta"].get("base") != self.base:  # adapters on another base: another model
      raise IncompatibleCheckpointError(
          f"cannot resume from {where}: its adapters were trained on the base "
          f"{meta['meta'].get('base')}, and model.init_from="
          f"{flatten(config_dict).get('model.init_from')!r} is {self.base} (use that base again)")
    allow = bool(flatten(config_dict).get("train.allow_batch_size_change", False))
    diffs = config_differences(saved, config_dict,
                               also_resumable=frozenset({BATCH_SIZE_KEY} if allow else ()))
    if diffs:
      hint = ("" if allow or not any(d.startswith(BATCH_SIZE_KEY + ":") for d in diffs) else
              "; to resume with another train.batch_size, set "
              "--config.train.allow_batch_size_change=True")
      raise IncompatibleCheckpointError(
          f"cannot resume from {where}: its config differs from this run's: "
          + "; ".join(diffs) + f" (use a new --workdir, or the same config{hint})")
    restored = self._read(where, step, ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    item = restored["data"]
    old_batch = flatten(saved)[BATCH_SIZE_KEY]
    check_data_item(item, where=f"cannot resume from {where}")
    data_state, old_count = item["iterator"], int(item["process_count"])
    changes = []
    if old_count != jax.process_count():
      changes.append(f"processes: {old_count} -> {jax.process_count()}")
    new_batch = flatten(config_dict)[BATCH_SIZE_KEY]
    if old_batch != new_batch:
      changes.append(f"train.batch_size: {old_batch} -> {new_batch}")
    self._verified.add(step)
    return Restored(state=restored["state"], data_state=data_state, step=step, changes=changes)

  def _read(self, where: str, step: int, args: Any) -> Any:
    """Orbax's restore of `args` at `step`; its errors (a checkpoint that matches its digest but
    that this version cannot read) become one `DamagedCheckpointError` line naming `where`."""
    try:
      return self._manager.restore(step, args=args)
    except Exception as e:  # pylint: disable=broad-except
      detail = errors.one_line(e)[:300]
      raise DamagedCheckpointError(
          f"cannot restore {where}: {type(e).__name__}: {detail} (move it away to resume from an "
          "older checkpoint, or use a new --workdir)") from e

  def maybe_save(self, step: int, state: Any, data_state: dict[str, Any],
                 config_dict: dict[str, Any], *, force: bool = False) -> bool:
    """Saves if `step` is a multiple of `every` (or `force`); returns whether it saved.

    `data_state` is this process's iterator state; it must be the same on every process (a
    position in the global stream), checked by gathering them. After the save, process 0 records
    the checkpoint's digest (a failure is a warning: that checkpoint is not verified, and the
    newest verified one is kept), then old checkpoints are rotated out. A KeyboardInterrupt (a
    second Ctrl-C) before the digest is written removes what the save wrote, a step without its
    digest would stop the rerun, and is raised again: the newest verified checkpoint stays.

    Raises:
      DataStateError: the processes' data states differ.
      CheckpointWriteError: the disk has less free space than the newest verified checkpoint
        takes, or the save failed for the disk (full, read-only, ...; what it wrote is removed):
        the newest verified checkpoint stays the one a rerun resumes from.
    """
    if not force and (self.every <= 0 or step % self.every):
      return False
    if step in self._manager.all_steps():
      return False
    states = _gather_json(data_state)
    if any(other != data_state for other in states.values()):
      raise DataStateError(
          f"step {step}: the processes' data positions differ, so no single position can be "
          f"saved: {states}")
    item = {"format": DATA_FORMAT, "iterator": data_state, "process_count": len(states)}
    check_data_item(item, where=f"step {step}: cannot save")
    try:
      self._save(step, ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(item),
          meta=ocp.args.JsonSave({"config": config_dict, "step": step, "base": self.base})))
      recorded = True
      if jax.process_index() == 0:
        try:
          digest_lib.write(os.path.join(self.directory, str(step)), step)
        except OSError as e:
          recorded = False
          logging.warning("checkpoint %s/%d: its digest could not be recorded (%s); it is not "
                          "verified, and rotation keeps the newest verified one", self.directory,
                          step, e)
    except KeyboardInterrupt:  # a second Ctrl-C (`run_guard.StopSignals`) stops the save at once
      if jax.process_index() == 0:
        digest_lib.remove_save(self.directory, step)
      raise
    if jax.process_count() > 1:
      recorded = bool(multihost_utils.broadcast_one_to_all(np.int32(recorded)))
    if recorded:
      self._verified.add(step)
    self._rotate()
    return True

  def _save(self, step: int, args: Any) -> None:
    """Orbax's save of `args` as `step`, finished when it returns.

    Raises:
      CheckpointWriteError: the free space is less than the newest verified checkpoint takes
        (nothing is written), or the save failed for the disk (`checkpoint_digest.write_errno`;
        orbax's threads log their own errors first).
    """
    last = self.latest_step()
    short = False
    if jax.process_index() == 0 and last is not None:
      need = digest_lib.tree_bytes(os.path.join(self.directory, str(last)))
      short = need is not None and shutil.disk_usage(self.directory).free < need
    if jax.process_count() > 1:
      short = bool(multihost_utils.broadcast_one_to_all(np.int32(short)))
    if short:
      raise CheckpointWriteError(self._write_failure(step, "not enough space", removed=False))
    try:
      self._manager.save(step, args=args, force=True)
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      code = digest_lib.write_errno(e)
      if code is None:
        raise  # not the disk: a bug, with its traceback
      line = self._write_failure(step, os.strerror(code), removed=True,  # free space before
                                 full=code in (errno.ENOSPC, errno.EDQUOT))  # the removal
      if jax.process_index() == 0:  # what the save left: orbax's temporary directory, or `step`
        digest_lib.remove_save(self.directory, step)
      raise CheckpointWriteError(line) from e

  def _write_failure(self, step: int, why: str, *, removed: bool, full: bool = True) -> str:
    """The one line of a save of `step` that failed (`why`): the directory, its free space, the
    checkpoint kept and what to do."""
    last = self.latest_step()
    kept = ("there is no earlier checkpoint" if last is None else
            f"the newest intact checkpoint, {self.directory}/{last}, is kept")
    size = (digest_lib.tree_bytes(os.path.join(self.directory, str(last)))
            if last is not None else None)
    takes = "" if size is None else f"; a checkpoint of this run takes {digest_lib.human(size)}"
    fix = ("free some space (or use a --workdir on a larger disk)" if full else
           f"make {self.directory} writable (or use another --workdir)")
    return (f"cannot save the checkpoint {self.directory}/{step}: {why} "
            f"({digest_lib.free_space(self.directory)}{takes}); "
            f"{'its partial files are removed and ' if removed else ''}{kept}: {fix}, then rerun "
            "to resume from it")

  def _rotate(self) -> None:
    """Deletes the checkpoints `checkpoint_digest.steps_to_remove` names (orbax's `delete`:
    process 0 removes the directory)."""
    for step in digest_lib.steps_to_remove(list(self._manager.all_steps()),
                                           verified=self._verified, keep=self.max_to_keep):
      if _plain_directory(os.path.join(self.directory, str(step))):
        self._manager.delete(step)
      elif jax.process_index() == 0:  # a link put there during the run: never deleted through
        self._quarantine(step, "not a checkpoint directory")
      self._verified.discard(step)

  def close(self) -> None:
    if self._orbax is not None:
      self._orbax.close()


def _plain_directory(path: str) -> bool:
  """Whether `path` is a directory and not a symbolic link (to one)."""
  return os.path.isdir(path) and not os.path.islink(path)


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

"""A run directory as the tools that read it see it: its newest intact checkpoint, the config
that wrote it, and its model with the saved parameters (`train.sample`, `train.export`).

The checkpoint chosen is the one the trainer would resume from (`checkpoint_digest.scan` and
`problem`, newest first); nothing in the workdir is moved or written.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from configs import packed as declared_configs
from train import checkpoint_digest as digest_lib
from segpack import errors
from segpack.data.mixture import parse_data
from train.model import decoder as model_lib
from train import run_guard
from train.checkpoint_compat import flatten
from train.runs.errors import RunError


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """`directory/step`, the checkpoint read (`choose_checkpoint`); `skipped`: one line
  naming the damaged newer ones passed over and the first bad file of each (None: none was)."""
  directory: str
  step: int
  skipped: str | None = None


def choose_checkpoint(workdir: str) -> Checkpoint:
  """The newest checkpoint of `WORKDIR/checkpoints` that matches its digest: the one the trainer
  would resume from (`checkpoint_digest.scan`, `problem`, newest first); moves nothing. Warns
  naming the damaged newer ones passed over (first bad file) and any entry that is no step.

  Raises:
    RunError: `workdir` has no checkpoint, or none matches its digest (naming each one's
      problem).
  """
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  steps = (listing := digest_lib.scan(directory)).steps  # none when not a directory
  if not steps:
    why = ("has no step directory" if os.path.isdir(directory) else "is not a directory"
           if os.path.lexists(directory) else "does not exist")
    raise RunError(f"--workdir {workdir!r} holds no checkpoint ({directory} {why})")
  damaged = []
  for step in steps:
    bad = digest_lib.problem(os.path.join(directory, str(step)), step)
    if bad is None:
      logging.log_if(logging.WARNING, "%s", listing.other, listing.skipped_line())
      skipped = (f"damaged checkpoint skipped: {'; '.join(damaged)}; reading the newest "
                 f"intact one, {directory}/{step}") if damaged else None
      logging.log_if(logging.WARNING, "%s", bool(damaged), skipped)
      return Checkpoint(directory=directory, step=step, skipped=skipped)
    damaged.append(f"{directory}/{step}: {' '.join(bad.split())}")
  raise RunError(f"--workdir {workdir!r} holds no intact checkpoint ({'; '.join(damaged)})")


class CheckpointGone(RunError):
  """The checkpoint being read was deleted (or changed) since it was chosen: a trainer still
  running removes its older checkpoints (`train.max_checkpoints`). `read_newest` chooses again."""


READ_TRIES = 3  # checkpoints chosen in turn before a read that keeps losing them gives up


def restore_item(checkpoint: Checkpoint, method: str, **kwargs: Any) -> Any:
  """`CheckpointManager.<method>(step, **kwargs)` of a manager that only reads; orbax's errors
  (a checkpoint that matches its digest but that it cannot read) become a RunError, and a
  CheckpointGone when the step directory or a file of it is gone or changed by then."""
  try:
    with ocp.CheckpointManager(
        checkpoint.directory, options=ocp.CheckpointManagerOptions(create=False),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                       "data": ocp.JsonCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()}) as manager:
      return getattr(manager, method)(checkpoint.step, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    where = f"{checkpoint.directory}/{checkpoint.step}"
    changed = digest_lib.problem(where, checkpoint.step)  # it matched its digest when chosen
    if changed is not None:
      raise CheckpointGone(f"{where} was deleted while it was read ({changed})") from e
    raise RunError(f"cannot read {where}: "
                   f"{type(e).__name__}: {errors.one_line(e)[:300]}") from e


def read_newest(workdir: str, read: Callable[[Checkpoint], Any], *,
                checkpoint: Checkpoint | None = None) -> tuple[Checkpoint, Any]:
  """`(the checkpoint read, read(it))`: `checkpoint` (None: `choose_checkpoint(workdir)`), and
  when it is deleted mid-read (`CheckpointGone`) the newest one chosen again, up to
  `READ_TRIES` checkpoints.

  Raises:
    RunError: every checkpoint chosen was deleted while it was read, or none is left (one
      line naming `--workdir` and the last checkpoint lost).
  """
  lost = None
  for _ in range(READ_TRIES):
    try:
      checkpoint = checkpoint or choose_checkpoint(workdir)
    except RunError as e:
      if lost is None:
        raise
      raise RunError(f"{errors.one_line(e)}; the checkpoint being read, {lost}, was "
                     f"deleted meanwhile") from None
    try:
      return checkpoint, read(checkpoint)
    except CheckpointGone as e:
      lost, checkpoint = f"{checkpoint.directory}/{checkpoint.step}", None
      logging.warning("%s; reading the newest checkpoint again", e)
  raise RunError(f"--workdir {workdir!r}: {READ_TRIES} checkpoints in turn were deleted while "
                 f"they were read (last {lost}): a trainer still running with a small "
                 f"train.max_checkpoints removes them; read again, or keep more checkpoints")


def added_keys() -> dict[str, Any]:
  """Keys added after runs were saved, with the value that means what those runs did (no
  adapters: the declared defaults)."""
  model = declared_configs.base_config().model
  return {"model.lora": model.lora.to_dict(), "model.init_adapter": model.init_adapter}


def missing_keys(saved: dict[str, Any]) -> list[str]:
  """The dotted keys every config declares (`configs.packed.base_config`) that the saved config
  `saved` lacks. A key is there when `saved` holds it, a group under it, or a value in place of
  the group holding it."""
  have = flatten(saved)

  def there(key: str) -> bool:
    parts = key.split(".")
    return (any(".".join(parts[:i]) in have for i in range(1, len(parts) + 1))
            or any(k.startswith(key + ".") for k in have))

  return [k for k in flatten(declared_configs.base_config().to_dict()) if not there(k)]


def run_config(workdir: str, *,
               checkpoint: Checkpoint | None = None) -> tuple[ml_collections.ConfigDict, int]:
  """The config that wrote the checkpoint (its `meta` item; `checkpoint` as in `sample`, the
  newest one chosen again if it is deleted meanwhile: `read_newest`) and its step. A saved
  config is complete or refused: its keys are read as they are, never defaulted.

  Raises:
    RunError: `workdir` has no intact checkpoint, or its config lacks a key every config
      declares (naming the checkpoint and the keys).
  """
  checkpoint, config = read_newest(workdir, lambda c: config_of(workdir, c),
                                   checkpoint=checkpoint)
  return config, checkpoint.step


def config_of(workdir: str, checkpoint: Checkpoint) -> ml_collections.ConfigDict:
  """`run_config` of that one checkpoint."""
  meta = restore_item(checkpoint, "restore",
                      args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  for key, value in added_keys().items():  # runs written before these keys did not use them
    group, name = meta["config"].get("model", {}), key.split(".")[1]
    if isinstance(group, dict) and name not in group:
      group[name] = value
  missing = missing_keys(meta["config"])
  if missing:
    raise RunError(f"{checkpoint.directory}/{checkpoint.step}: the run's saved config has no "
                   f"{', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''} "
                   f"({len(missing)} of the keys every config declares); a run is read back "
                   f"from a complete config only")
  return kept_datasets(ml_collections.ConfigDict(meta["config"]), workdir)


def kept_datasets(config: ml_collections.ConfigDict,
                  workdir: str) -> ml_collections.ConfigDict:
  """`config` with every local `data.train` dataset that is gone (no manifest there: moved or
  deleted, or a relative path read from another directory) replaced by the copy of its manifest
  and tokenizer files the run kept (`WORKDIR/datasets/<k>`, `run_guard.keep_datasets`)."""
  dirs = run_guard.training_dirs(config.data.train)
  kept = [os.path.join(workdir, run_guard.KEPT_DIR, str(k)) for k in range(len(dirs))]
  swap = {d: c for d, c in zip(dirs, kept)
          if not os.path.isfile(os.path.join(d, "manifest.json"))
          and os.path.isfile(os.path.join(c, "manifest.json"))}
  if not swap:
    return config
  if len(dirs) == 1 and config.data.train == dirs[0]:
    config.data.train = swap[dirs[0]]
    return config
  mixture = parse_data(str(config.data.train))
  config.data.train = ",".join(f"{m.name}={swap.get(str(m.source), m.source)}:{m.weight!r}"
                               for m in mixture.sources)
  return config


def sampling_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config` whose attention runs on XLA (no kernel settings, no mesh)."""
  copy = ml_collections.ConfigDict(config.to_dict())
  copy.attention.implementation = "xla"
  copy.attention.interpret = False
  return copy


def saved_vocab_size(state_tree: Any, *, where: str) -> int:
  """Rows of the checkpoint's embedding table (in `state_tree`, orbax's tree of the saved state's
  shapes): the vocabulary the run trained with."""
  node = state_tree["params"]["embed"]["embedding"]
  if isinstance(node, dict) or hasattr(node, "keys"):
    node = node["value"]
  if len(getattr(node, "shape", ())) != 2:
    raise RunError(f"{where}: params.embed.embedding has no [V, E] shape: {node!r}")
  return int(node.shape[0])


def restore_params(checkpoint: Checkpoint, abstract_params: Any, shardings: Any) -> Any:
  """The checkpoint's `params` (of its train state) read into `abstract_params`' shapes, placed
  with `shardings` (a tree of them, or one sharding for all)."""
  if not isinstance(shardings, jax.sharding.Sharding):
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract_params, shardings)
  else:
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings),
                          abstract_params)
  target = {"params": target}
  restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
  restored = restore_item(checkpoint, "restore", args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                   partial_restore=True)))
  return restored["state"]["params"]


def plain_model(checkpoint: Checkpoint, config: ml_collections.ConfigDict) -> model_lib.Decoder:
  """The model of a run without adapters from one checkpoint: `train.model.decoder.build` of the
  saved config with `attention.implementation="xla"` and the vocabulary size of the saved
  embedding table (the trainer's, whatever `model.vocab_size` says); only the parameters are
  read, onto the first device (`train.runs.loaded.load_run` chooses it or the adapted model)."""
  vocab = saved_vocab_size(restore_item(checkpoint, "item_metadata")["state"],
                           where=f"{checkpoint.directory}/{checkpoint.step}")
  abstract = model_lib.abstract(sampling_config(config), vocab_size=vocab)
  graphdef, abstract_params = nnx.split(abstract)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return nnx.merge(graphdef, restore_params(checkpoint, abstract_params, device))

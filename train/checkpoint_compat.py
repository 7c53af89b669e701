"""What a checkpoint must match for a run to resume from it (`train.checkpoint`): the config that
wrote it, compared key by key outside `RESUMABLE_CHANGES`, and its data item, the position of
the training data (`{"format": 3, "iterator": STATE, "process_count": Q}`), checked on save and
restore.
"""

from __future__ import annotations

from typing import Any

from segpack.data import position as position_lib
from segpack.errors import UserError
from train import run_guard

# Config keys that may change between a run and its resumption (they do not change the math of
# the steps already taken or the batches still to come).
RESUMABLE_CHANGES = frozenset({
    "train.num_steps", "train.num_epochs", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.checkpoint_every", "train.max_checkpoints", "train.log_batches", "mesh.data",
    "mesh.fsdp", "mesh.tensor", "mesh.context", "packing.context_balance",
    "attention.implementation", "attention.interpret", "loss.block_size", "model.remat",
    "attention.self_check", "train.peak_flops", "data.cache_dir", "train.allow_batch_size_change",
    "loss.vocab_block_size",  # (loss.*block_size, model.remat: the same loss, in less memory)
})
# Resumable only when the current config says `train.allow_batch_size_change=True`: the data
# position is a row of the stream, so the next steps simply take another number of rows.
BATCH_SIZE_KEY = "train.batch_size"
DATA_FORMAT = 3  # 3: the iterator state is segpack.data.position's version 1
# `loss.weighting` is deliberately not resumable: it changes the objective being optimised.


class IncompatibleCheckpointError(UserError, ValueError):
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
  a, b = ({k: run_guard.absolute_value(k, v) for k, v in flatten(c).items()}  # a path saved
          for c in (saved, current))  # relative by an older run: against this directory
  lines = []
  for key in sorted(set(a) | set(b)):
    if key in RESUMABLE_CHANGES or key in also_resumable:
      continue
    if a.get(key, "<absent>") != b.get(key, "<absent>"):
      lines.append(f"{key}: checkpoint has {a.get(key, '<absent>')!r}, "
                   f"config has {b.get(key, '<absent>')!r}")
  return lines


class DataStateError(UserError, ValueError):
  """The checkpoint's data position cannot be restored (or the processes disagree on it)."""


def check_data_item(item: Any, *, where: str) -> None:
  """Refuses a data item that is not `{"format": DATA_FORMAT, "iterator": STATE,
  "process_count": Q}` with a version-1 iterator state (`segpack.data.position.read_state`).

  Raises:
    DataStateError: one line starting with `where`, naming the field and its value.
  """
  got = item.get("format") if isinstance(item, dict) else item
  if got != DATA_FORMAT:
    raise DataStateError(f"{where}: its data item has format {got!r}, this version reads "
                         f"format {DATA_FORMAT} only; start a new --workdir")
  count = item.get("process_count")
  if not isinstance(count, int) or isinstance(count, bool) or count < 1:
    raise DataStateError(f"{where}: its data item has process_count={count!r}, not an int >= 1")
  try:
    position_lib.read_state(item.get("iterator"))
  except position_lib.StreamStateError as e:
    raise DataStateError(f"{where}: {e}; start a new --workdir") from e

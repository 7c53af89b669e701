"""Trainer configs for the data tests: `configs/packed.py`'s config with some keys of its `data`
and `packing` groups set (each key as the config declares it; `train.data` reads them there)."""

from typing import Any

import ml_collections

from configs import packed


def data_config(base: ml_collections.ConfigDict | None = None,
                **keys: Any) -> ml_collections.ConfigDict:
  """A copy of `base` (default: `packed.get_config()`) with every key of `keys` set in the group
  that declares it (`data` or `packing`; `context_size` is `mesh.context`)."""
  config = packed.get_config() if base is None else base.copy_and_resolve_references()
  for name, value in keys.items():
    if name == "context_size":
      config.mesh.context = value
      continue
    groups = [g for g in ("data", "packing") if name in config[g]]
    if len(groups) != 1:
      raise KeyError(f"data_config: {name!r} is a key of {groups or 'no group'}")
    config[groups[0]][name] = value
  return config

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


# The small built-in corpus read plainly: first-fit-decreasing, long documents split, BOS and
# EOS, seed 0, no synthetic data.
BUILTIN_KEYS = dict(source="builtin", size="small", cache_dir=None, strategy="ffd",
                    long_docs="split", max_segments_per_row=None, add_bos=True, add_eos=True,
                    seed=0, synthetic_docs=0, synthetic_mean_len=1, synthetic_vocab=1)


def builtin_data_config(**keys: Any) -> ml_collections.ConfigDict:
  """`data_config` with `BUILTIN_KEYS` set, then `keys` (which name `seq_len`, and may name
  `train` to read a dataset instead)."""
  return data_config(**{**BUILTIN_KEYS, **keys})

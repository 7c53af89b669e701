"""A finished run's model read back, with or without adapters: the one entry of the sampler,
the scorer and the benchmarks (above `train.runs.saved`, which reads a plain run, and
`train.runs.adapted`, which reads adapters and the base they trained on)."""

from __future__ import annotations

from typing import Any

import ml_collections

from train.runs import adapted
from train.runs import saved as saved_run


def load_run(workdir: str, *, checkpoint: saved_run.Checkpoint | None = None
             ) -> tuple[ml_collections.ConfigDict, Any, int]:
  """The run's config, its model with the checkpoint's parameters, and that step.

  A run without adapters: `train.runs.saved.plain_model`; with adapters, the adapters over the
  base they trained on (`train.runs.adapted.load_model`). `checkpoint` is as in `sample` (the
  newest one chosen again if it is deleted meanwhile: `train.runs.saved.read_newest`); raises
  RunError when `workdir` has no intact checkpoint.
  """

  def load(c: saved_run.Checkpoint) -> tuple[ml_collections.ConfigDict, Any]:
    config = saved_run.config_of(workdir, c)
    if adapted.is_adapted(config):
      return config, adapted.load_model(c, config)
    return config, saved_run.plain_model(c, config)

  checkpoint, (config, model) = saved_run.read_newest(workdir, load, checkpoint=checkpoint)
  return config, model, checkpoint.step

r"""Trains a decoder LM on packed rows: `python -m train.main --config=configs/packed.py`.

Flags: `--config` (a config file, `:smoke` for a run of seconds, `--config.a.b=v` overrides) and
`--workdir` (default `./runs/<config file name>[_<arg>]`). Multi-host: pass `--distributed` on
every host (`jax.distributed.initialize()` then finds the cluster from the environment).
"""

import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from train import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Trainer config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default ./runs/<config name>).")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize().")


def default_workdir(config_path: str) -> str:
  """`configs/packed.py:smoke` -> `./runs/packed_smoke`."""
  path, _, arg = config_path.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}_{arg}" if arg else name)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; --verbosity=0 shows it
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  workdir = _WORKDIR.value or default_workdir(flags.FLAGS["config"].config_filename)
  try:
    train.train_and_evaluate(_CONFIG.value, workdir)
  except train.USER_ERRORS as e:
    print(f"train.main: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)

r"""Trains a decoder LM on packed rows: `python -m train.main --config=configs/packed.py`.

Flags: `--config` (a config file, `:smoke` for a run of seconds, `--config.a.b=v` overrides) and
`--workdir` (default `./runs/<config file name>[_<arg>][-<hash of the overrides a run cannot
resume across>]`, `train.launch.default_workdir`). Multi-host: pass `--distributed` on
every host (`jax.distributed.initialize()` then finds the cluster from the environment).

Every mistake of the command line or the config (a missing config file, an unknown `:variant`, a
bad override, a `segpack.errors.UserError` from the run) is printed as one line,
`python -m train.main: error: <message>`, with exit code 2 (`segpack.errors.command`, the path
every command ends through; `train.launch`).
"""

import sys
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from segpack import errors
from train import launch

_CONFIG = config_flags.DEFINE_config_file("config", None, "Trainer config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default ./runs/<config name>).")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize().")


def main(argv: Sequence[str]) -> int:
  """Trains with the parsed flags (`argv`: what absl left, the program first)."""
  if len(argv) > 1:
    raise errors.UsageError(f"unexpected arguments: {list(argv[1:])}")
  return launch.run(_CONFIG.value, workdir=_WORKDIR.value,
                    config_filename=flags.FLAGS["config"].config_filename,
                    overrides=config_flags.get_override_values(flags.FLAGS["config"]),
                    distributed=_DISTRIBUTED.value)


@errors.command(launch.PROG)
def cli(argv: Sequence[str] | None = None) -> int:
  """`python -m train.main`: absl's flags (`launch.parse_flags`), then `main`."""
  app.run(main, argv=argv, flags_parser=launch.parse_flags)
  return 0


if __name__ == "__main__":
  sys.exit(cli())

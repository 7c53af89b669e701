"""The command blocks of README.md, as a test runs them."""

import shlex

from support import paths
from support.train_configs import run_cli


def commands(section: str) -> list[str]:
  """The lines of the first ```bash block after the README heading `section` (`## Title`),
  comment lines left out."""
  readme = (paths.REPO / "README.md").read_text()
  block = readme.split(section, 1)[1].split("```bash", 1)[1]
  return [c.strip() for c in block.split("```", 1)[0].strip().splitlines()
          if c.strip() and not c.strip().startswith("#")]


def run(commands: list[str], subs: dict[str, str], *, train_args: list[str]):
  """Runs each command as a new user would, with the README's names replaced by `subs` (in
  order) and `train_args` added to `python -m train.main` (fewer steps); yields `(args, the
  finished process)` of each (a failed one fails the test)."""
  for command in commands:
    for a, b in subs.items():
      command = command.replace(a, b)
    args = shlex.split(command)[2:]
    if args[0] == "train.main":
      args += train_args
    yield args, run_cli(*args)

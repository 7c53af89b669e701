"""`python -m train.sample`: decode from a run (`train.sample.command`)."""

import sys

from train.sample import command

sys.exit(command.cli())

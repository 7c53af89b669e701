"""`python -m train.export`: a run as a Hugging Face directory (`train.export.command`)."""

import sys

from train.export import command

sys.exit(command.main())

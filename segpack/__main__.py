"""`python -m segpack COMMAND ...`: the `segpack` command (see `segpack.cli.main`)."""

import sys

from segpack.cli.main import main

sys.exit(main())

"""Where the repository is, for tests that run its commands or read its files."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]

"""`segpack`: one command with declared subcommands (also `python -m segpack`).

  segpack tokenize --input builtin --output data/builtin     # text to a shard dataset
  segpack stats --data data/builtin/train --compare           # packing statistics
  segpack bench packing | attention | tokenize | gpu-report | chat-turns [--json]  # benchmarks

Each subcommand takes the flags of its module's `main` (`segpack tokenize --help`). A
subcommand's module is imported only when it runs, so `segpack tokenize` starts without JAX and
Grain, which only the benchmarks and `stats` need.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from segpack import errors

__all__ = ["COMMANDS", "BENCHMARKS", "main"]

# name -> (module whose `main(argv)` runs it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "tokenize": ("segpack.cli.tokenize", "tokenize text into a shard dataset (docs/format.md)"),
    "stats": ("segpack.cli.stats", "packing statistics of a dataset; --compare for every planner"),
}
BENCHMARKS: dict[str, tuple[str, str]] = {
    "packing": ("segpack.bench.packing", "planning speed and quality, Grain's packers, loading"),
    "attention": ("segpack.bench.attention",
                  "tiles computed vs dense vs ideal; GPU times on a GPU"),
    "tokenize": ("segpack.bench.tokenize", "segpack tokenize against the tokenizer alone, and "
                                           "where its time goes"),
    "gpu-report": ("segpack.bench.gpu_report", "on a GPU: every backend vs a float32 reference, "
                                               "timings, one JSON file"),
    "chat-turns": ("segpack.bench.chat_turns", "chat stored one sample per assistant turn: "
                                               "tokens against the whole conversation"),
}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="segpack", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for name, (_, help_text) in COMMANDS.items():
    sub.add_parser(name, help=help_text, add_help=False)
  bench = sub.add_parser("bench", help="benchmarks (print a table, or JSON with --json)")
  which = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
  for name, (_, help_text) in BENCHMARKS.items():
    which.add_parser(name, help=help_text, add_help=False)
  return p


@errors.command("segpack")
def main(argv: Sequence[str] | None = None) -> int:
  """Runs `segpack COMMAND ...`; returns the subcommand's exit status (each subcommand ends its
  errors as `segpack.errors` says)."""
  # The subcommand's own flags are left unparsed here and handed to its `main`, which checks them.
  args, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else list(argv))
  module = (BENCHMARKS[args.benchmark] if args.command == "bench" else COMMANDS[args.command])[0]
  return importlib.import_module(module).main(rest)


if __name__ == "__main__":
  sys.exit(main())

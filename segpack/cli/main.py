"""`segpack`: one command with declared subcommands (also `python -m segpack`).

  segpack tokenize --input builtin --output data/builtin     # text to a shard dataset
  segpack stats --data data/builtin/train --compare           # packing statistics
  segpack bench packing | attention | gpu-report [--json]    # benchmarks

Each subcommand takes the flags of its module's `main` (`segpack tokenize --help`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from segpack.bench import attention as bench_attention
from segpack.bench import gpu_report as bench_gpu_report
from segpack.bench import packing as bench_packing
from segpack import errors
from segpack.cli import stats as stats_cli
from segpack.cli import tokenize as tokenize_cli

__all__ = ["COMMANDS", "BENCHMARKS", "main"]

# name -> (entry point taking argv, one-line help)
COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "tokenize": (tokenize_cli.main, "tokenize text into a shard dataset (docs/format.md)"),
    "stats": (stats_cli.main, "packing statistics of a dataset; --compare for every strategy"),
}
BENCHMARKS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "packing": (bench_packing.main, "planning speed and quality, Grain's packers, loading"),
    "attention": (bench_attention.main, "tiles computed vs dense vs ideal; GPU times on a GPU"),
    "gpu-report": (bench_gpu_report.main, "on a GPU: every backend vs a float32 reference, "
                                          "timings, one JSON file"),
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
  if args.command == "bench":
    return BENCHMARKS[args.benchmark][0](rest)
  return COMMANDS[args.command][0](rest)


if __name__ == "__main__":
  sys.exit(main())

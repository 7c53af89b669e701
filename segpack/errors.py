"""The project's one error base, and how every command ends on an error.

`UserError` is the base of every error that reports a mistake in the user's input (a flag, a
config key, a file, a dataset, a checkpoint): its message names the argument, file or key and
echoes the value. Each project error class derives from it and from the builtin it refines
(`ValueError`, `TypeError`, `OSError`), so `except ValueError` keeps working; a bare argument
check raises `ArgumentError` / `ArgumentTypeError`. Everything else is a bug.

A message names what its caller wrote:

- A library function names its own arguments as Python spells them, with the value as
  `name=value` where it echoes one: `workers must be a positive int, got 0`,
  `chat_template='own'`. It never names a command-line flag alone.
- Where a command hands a flag straight to a library argument (`segpack tokenize` runs
  `segpack.text.dataset.tokenize_files`, one flag per argument), the library's message names
  both, the flag in parentheses after the argument: `workers (--workers) must be a positive
  int, got 0`, `chat_template='own' (--chat-template)`, `pass overwrite=True (--overwrite)`. One
  element of a list argument is named by its value, then the argument and the flag:
  `input 'a.txt' (inputs, --input)`.
- The command prints the library's message as it is (no re-wording, no mapping of names); the
  command's own checks (`segpack/cli`, argparse) name its flags only.

`command(prog)` wraps a command-line `main`:

- A `UserError`, or an `OSError` (the operating system names the file), ends with one line on
  stderr, `PROG: error: MESSAGE`, and exit status 2.
- Ctrl-C ends with one line and exit status 130.
- Anything else is a bug: its traceback is printed, then one line asking to report it, and the
  exit status is 1 (a `ValueError` raised inside NumPy or JAX included).
- argparse's own errors (an unknown flag, a value of the wrong type) keep argparse's usage line
  and one error line, exit status 2 (`SystemExit` passes through).

Example:

    @errors.command("python -m train.plot")
    def main(argv: Sequence[str] | None = None) -> int:
      ...
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from collections.abc import Callable, Sequence

__all__ = ["ArgumentError", "ArgumentTypeError", "PipelineConfigError", "UsageError", "UserError",
           "at_least", "command", "directory", "is_user_error", "one_line"]

class UserError(Exception):
  """A mistake in the user's input; the message names the argument, file or key and echoes the
  value. Commands print it as one line with exit status 2 (`command`)."""


class ArgumentError(UserError, ValueError):
  """An argument's value is unusable (a bare argument check of the project's code)."""


class ArgumentTypeError(UserError, TypeError):
  """An argument has the wrong type."""


class PipelineConfigError(UserError, ValueError):
  """An argument of the data pipeline (`pack_dataset`, `pack_minibatches`, their planners) is
  invalid; the message names it and echoes the value (re-exported by `segpack.data.options`)."""


class UsageError(ArgumentError):
  """A command-line argument is unusable; the message names the argument and echoes its value."""


def is_user_error(error: BaseException) -> bool:
  """Whether `error` reports bad input rather than a bug: a `UserError`, or an `OSError` (the
  operating system names the file)."""
  return isinstance(error, (UserError, OSError))


def one_line(error: BaseException) -> str:
  """The error's message on one line (a library's message may span several)."""
  return " ".join(str(error).split()) or type(error).__name__


def command(prog: str) -> Callable[[Callable[..., int | None]], Callable[..., int]]:
  """Decorates a `main(argv=None) -> int | None` so that it ends as the module docstring says.

  Args:
    prog: the command as typed (`"segpack tokenize"`), the first word of every message.
  """
  def decorate(main: Callable[..., int | None]) -> Callable[..., int]:
    @functools.wraps(main)
    def run(argv: Sequence[str] | None = None) -> int:
      try:
        status = main(argv)
      except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
      except Exception as e:  # pylint: disable=broad-except
        if is_user_error(e):
          print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
          return 2
        traceback.print_exc()
        print(f"{prog}: internal error, please report it with the traceback above",
              file=sys.stderr)
        return 1
      return 0 if status is None else status
    run.command_prog = prog  # type: ignore[attr-defined]  # tests find the wrapped entry points
    return run
  return decorate


def at_least(minimum: int | float, kind: type = int) -> Callable[[str], int | float]:
  """An argparse `type=`: a number of `kind` >= `minimum` (else argparse's one error line names
  the flag and echoes the value, exit status 2)."""
  def parse(text: str) -> int | float:
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not value >= minimum:  # `not >=` also refuses NaN.
      raise argparse.ArgumentTypeError(f"expected {kind.__name__} >= {minimum}, got {text!r}")
    return value
  parse.__name__ = kind.__name__
  return parse


def directory(text: str) -> str:
  """An argparse `type=`: an existing directory."""
  if not os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text!r} is not an existing directory")
  return text

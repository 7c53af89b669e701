"""How every command ends on an error: `command(prog)` wraps a command-line `main`.

- A user error (a bad flag value, a missing or unreadable file, a damaged dataset) ends with one
  line on stderr, `PROG: error: MESSAGE`, and exit status 2. User errors are `OSError` (the
  operating system names the file), the `ValueError` and `TypeError` subclasses that segpack
  and its trainer raise on purpose for bad input (`InputFormatError`, `ShardFormatError`,
  `DataArgumentError`, `ConfigError`, ...), which name the flag, file or key and echo the value,
  and a bare `ValueError` raised by a `raise` statement in segpack's or the trainer's own code.
- Ctrl-C ends with one line and exit status 130.
- Anything else is a bug: its traceback is printed, then one line asking to report it, and the
  exit status is 1. A bare `ValueError` raised deep inside NumPy or JAX is such an internal error,
  not a user error.
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

__all__ = ["UsageError", "at_least", "command", "directory", "is_user_error", "one_line"]

_PROJECT_PACKAGES = ("segpack", "train")


class UsageError(ValueError):
  """A command-line argument is unusable; the message names the argument and echoes its value."""


# The directories of the project's packages: a bare ValueError raised by a statement in them is
# raised on purpose (its message names the argument and value).
_PROJECT_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), name) + os.sep for name in _PROJECT_PACKAGES)


def _raised_by_project(error: BaseException) -> bool:
  """Whether the innermost frame of `error`'s traceback is project code (a `raise` of segpack or
  the trainer), not NumPy, JAX or another library."""
  tb = error.__traceback__
  if tb is None:
    return False
  while tb.tb_next is not None:
    tb = tb.tb_next
  return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PROJECT_DIRS)


def is_user_error(error: BaseException) -> bool:
  """Whether `error` reports bad input (see the module docstring) rather than a bug.

  User errors: `OSError`; the project's own `ValueError`/`TypeError` subclasses; a bare
  `ValueError` raised by a `raise` statement of the project's code (its argument checks). A bare
  `ValueError` or `TypeError` raised inside a library (NumPy, JAX, ...) is a bug.
  """
  if isinstance(error, OSError):
    return True
  if not isinstance(error, (ValueError, TypeError)):
    return False
  if any(cls.__module__.partition(".")[0] in _PROJECT_PACKAGES
         for cls in type(error).__mro__ if cls not in (ValueError, TypeError)):
    return True
  return type(error) is ValueError and _raised_by_project(error)


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

"""The code blocks of README.md and docs/*.md, as the tests read and run them.

A block is named by its document, the heading above it and its place under that heading
(`block("README.md", "## Use", 1)`); `tests/docs/test_inventory.py` holds what runs each one.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys

from support import paths
from support.train_configs import run_cli

_OPERATORS = ("&&", "||", "|", ";")
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (paths.REPO / "docs").glob("*.md")))


@dataclasses.dataclass(frozen=True)
class Block:
  """One fenced code block: `language` ("bash", "python") and its `text`."""
  doc: str
  heading: str
  index: int
  language: str
  text: str

  @property
  def key(self) -> tuple[str, str, int]:
    return (self.doc, self.heading, self.index)

  def commands(self) -> list[str]:
    """A bash block's command lines: continuations joined, comments and blank lines left out,
    each as its words joined by spaces (quoted where needed; `&&` left as it is)."""
    out = []
    for line in self.text.replace("\\\n", " ").splitlines():
      try:
        words = shlex.split(line, comments=True)
      except ValueError:  # a line of a multi-line string (python -c "...", a heredoc)
        out.append(line.strip())
        continue
      if words:
        out.append(" ".join(w if w in _OPERATORS else shlex.quote(w) for w in words))
    return out


def blocks() -> list[Block]:
  """Every fenced block with a language, in document order (a `#` line inside a block is no
  heading)."""
  out = []
  for doc in DOCS:
    heading, seen, fence = "", {}, None
    for line in (paths.REPO / doc).read_text(encoding="utf-8").splitlines():
      if fence is not None:
        if line.startswith("```"):
          seen[heading] = seen.get(heading, -1) + 1
          out.append(Block(doc, heading, seen[heading], fence[0], "".join(fence[1:])))
          fence = None
        else:
          fence.append(line + "\n")
      elif line.startswith("```"):
        fence = [line[3:].strip()] if line[3:].strip() else None
      elif line.startswith("#"):
        heading = line
  return out


def block(doc: str, heading: str, index: int = 0) -> Block:
  """The block `index` under `heading` of `doc`."""
  found = [b for b in blocks() if b.key == (doc, heading, index)]
  assert found, f"{doc}: no block {index} under {heading!r}"
  return found[0]


def commands(section: str, *, doc: str = "README.md", index: int = 0) -> list[str]:
  """The command lines of a bash block (`Block.commands`)."""
  return block(doc, section, index).commands()


def python_m(command: str) -> tuple[list[str], dict[str, str]]:
  """`(the words after "python -m", the NAME=VALUE words before it)` of a command line, past a
  `pip install ... &&` and a `time`; `([], {})` for another command."""
  words = shlex.split(command)
  if "&&" in words:
    words = words[len(words) - words[::-1].index("&&"):]
  env = {}
  while words and (words[0] == "time" or ("=" in words[0] and not words[0].startswith("-"))):
    word = words.pop(0)
    if word != "time":
      name, value = word.split("=", 1)
      env[name] = value
  return (words[2:], env) if words[:2] == ["python", "-m"] else ([], {})


def run(commands: list[str], subs: dict[str, str], *, train_args: list[str], cwd=paths.REPO,
        env: dict[str, str] | None = None, python: str | None = None):
  """Runs each command as a new user would, from `cwd`, with the document's names replaced by
  `subs` (in order) and `train_args` added to `python -m train.main` (fewer steps); yields
  `(args after "python -m", the finished process)` of each (a failed one fails the test).

  `pip install ...` before `&&` is what made this environment and is not run again; `NAME=VALUE`
  words before `python` are the command's environment, beside `env`. A command sees one CPU
  device, as on a new user's machine (`train_configs.run_cli`); `python` runs it in another
  environment (None: this one's)."""
  for command in commands:
    for a, b in subs.items():
      command = command.replace(a, b)
    args, command_env = python_m(command)
    assert args, f"not a python -m command: {command}"
    command_env = {**(env or {}), **command_env}
    if args[0] == "train.main":
      args += train_args
    yield args, run_cli(*args, cwd=cwd, env=command_env, python=python or sys.executable)


def python_block(text: str, namespace: dict, cwd) -> dict:
  """Executes a python block's `text` in `namespace` (the names the document leaves to the
  reader), from `cwd`; returns the namespace."""
  old = os.getcwd()
  os.chdir(cwd)
  try:
    exec(compile(text, "<doc block>", "exec"), namespace)  # noqa: S102  # the document's code
  finally:
    os.chdir(old)
  return namespace

"""Input readers: text files, JSONL (optionally gzipped) and the detection of chat inputs.

Inputs are read in the order given (a directory: its `.txt`, `.jsonl` and `.jsonl.gz` files in
sorted order): a `.txt` file is one document (or, with `--doc-separator blank-line`, one document
per block of lines between blank lines); a `.jsonl[.gz]` line is a JSON object whose
`--text-field` is one document. Every unusable input raises `InputFormatError` naming the file,
the line and the value.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["InputFormatError", "ReadCounters", "expand_inputs", "is_chat", "iter_documents"]


_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")


class InputFormatError(ValueError):
  """An input file, line or argument is unusable; the message names it and the value."""


@dataclasses.dataclass
class ReadCounters:
  """What `iter_documents` skipped: `bad_lines` (with `skip_bad_lines`)."""

  bad_lines: int = 0


def expand_inputs(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
  """Input files in order: a directory contributes its supported files, sorted."""
  files = []
  for raw in paths:
    path = Path(raw)
    if path.is_dir():
      found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(_SUFFIXES))
      if not found:
        raise InputFormatError(f"--input {str(path)!r}: directory holds no {'/'.join(_SUFFIXES)} "
                               f"files")
      files.extend(found)
    elif not path.exists():
      raise InputFormatError(f"--input {str(path)!r}: no such file or directory")
    elif not path.name.endswith(_SUFFIXES):
      raise InputFormatError(f"--input {str(path)!r}: unsupported file type (expected "
                             f"{', '.join(_SUFFIXES)})")
    else:
      files.append(path)
  return files


def _read_txt(path: Path, doc_separator: str) -> Iterator[str]:
  try:
    with open(path, encoding="utf-8", newline="") as f:
      if doc_separator == "file":
        yield f.read()
        return
      block: list[str] = []
      for line in f:
        if line.strip():
          block.append(line)
        elif block:
          yield "".join(block)
          block = []
      if block:
        yield "".join(block)
  except UnicodeDecodeError as e:
    raise InputFormatError(f"{path}: not UTF-8 text ({e})") from e


def _numbered_lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
  """(line number, line) pairs; a corrupt or truncated gzip stream becomes an InputFormatError."""
  lineno = 0
  try:
    for lineno, raw in enumerate(f, start=1):
      yield lineno, raw
  except (OSError, EOFError, zlib.error) as e:
    raise InputFormatError(f"{path}: unreadable after line {lineno} ({type(e).__name__}: {e})"
                           ) from e


def _read_jsonl(path: Path, text_field: str, skip_bad_lines: bool,
                counters: ReadCounters) -> Iterator[str]:
  opener = gzip.open if path.name.endswith(".gz") else open
  with opener(path, "rb") as f:
    for lineno, raw in _numbered_lines(f, path):
      if not raw.strip():
        continue
      try:
        record = json.loads(raw)
        problem = None
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"not JSON ({e}): {raw[:80]!r}"
      if problem is None:
        if not isinstance(record, dict) or text_field not in record:
          found = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
          problem = f"no field {text_field!r} (found: {found})"
        elif not isinstance(record[text_field], str):
          problem = (f"field {text_field!r} is {type(record[text_field]).__name__}, not a string: "
                     f"{record[text_field]!r:.80}")
      if problem is not None:
        if skip_bad_lines:
          counters.bad_lines += 1
          continue
        raise InputFormatError(f"{path}:{lineno}: {problem} (pass --skip-bad-lines to count and "
                               f"skip such lines)")
      yield record[text_field]


def iter_documents(
    files: Sequence[Path], *, doc_separator: str = "file", text_field: str = "text",
    skip_bad_lines: bool = False, counters: ReadCounters | None = None,
) -> Iterator[str]:
  """The documents of `files`, in order (see the module docstring for the formats).

  Args:
    files: input files (`expand_inputs` turns CLI paths into these).
    doc_separator: `.txt`: "file" (a file is a document) or "blank-line".
    text_field: `.jsonl[.gz]`: the field holding the text.
    skip_bad_lines: `.jsonl[.gz]`: count lines that are not JSON objects with a string
      `text_field` in `counters` and go on, instead of raising InputFormatError.
    counters: where skipped lines are counted.

  Yields:
    Document texts (possibly empty: the writer counts and skips those).
  """
  if doc_separator not in ("file", "blank-line"):
    raise InputFormatError(f"--doc-separator must be 'file' or 'blank-line', got "
                           f"{doc_separator!r}")
  counters = counters if counters is not None else ReadCounters()
  for path in files:
    if path.name.endswith(".txt"):
      yield from _read_txt(path, doc_separator)
    else:
      yield from _read_jsonl(path, text_field, skip_bad_lines, counters)


def is_chat(files: Sequence[Path], input_format: str, *, text_field: str,
             messages_field: str) -> bool:
  """Whether the inputs are chat conversations (`--format auto`: the first JSONL record has
  `messages_field` and no `text_field`)."""
  if input_format not in ("auto", "text", "chat"):
    raise InputFormatError(f"--format must be auto, text or chat, got {input_format!r}")
  if input_format != "auto":
    if input_format == "chat" and any(not p.name.endswith((".jsonl", ".jsonl.gz"))
                                      for p in files):
      raise InputFormatError(f"--format chat reads .jsonl[.gz] files only, got "
                             f"{[str(p) for p in files]}")
    return input_format == "chat"
  first = files[0]
  if not first.name.endswith((".jsonl", ".jsonl.gz")):
    return False
  opener = gzip.open if first.name.endswith(".gz") else open
  try:
    with opener(first, "rb") as f:
      for raw in f:
        if raw.strip():
          record = json.loads(raw)
          return (isinstance(record, dict) and messages_field in record
                  and text_field not in record)
  except (OSError, EOFError, zlib.error, ValueError):
    return False  # The text reader reports what is wrong with the file.
  return False

"""Input readers: text, JSONL, Parquet, `datasets` `save_to_disk` directories; chat detection.

Inputs are read in the order given (a directory: its supported files, sorted by path; the
others are counted by type, `expand_inputs(skipped=...)`, and `describe_inputs` says what was
read and what was not):

* `.txt` (also `.txt.gz`, `.txt.zst`): one document per file, or, with
  `--doc-separator blank-line`, one per block of lines between blank lines;
* `.jsonl` (also `.jsonl.gz`, `.jsonl.zst`): one JSON object per line, its `--text-field` is a
  document (blank lines are skipped);
* `.parquet`: column `--text-field`, one document per row, read in record batches;
* `hf-disk:PATH`: a Hugging Face `datasets` directory written by `save_to_disk` (one split:
  `hf-disk:PATH/SPLIT` for a `DatasetDict`), its Arrow files read like Parquet
  (`segpack.text.arrow_inputs`).

`.zst` needs the `zstandard` package (`segpack[zstd]`) and Parquet / `hf-disk:` need pyarrow
(`segpack[parquet]`); both are imported only when such an input is read.

A record is usable when its field is a string (a Parquet / Arrow `binary` cell: UTF-8 bytes).
Anything else (not JSON, not an object, no such field, a number, a null, text that is not valid
UTF-8 or holds unpaired surrogates) raises `InputFormatError` naming the file, the record (the
JSONL line number, the Parquet / Arrow row, both 1-based within the file) and the value; with
`skip_bad_lines` such records are counted in `ReadCounters.bad_lines` and skipped instead. A
file that cannot be read to its end (corrupt or truncated gzip / zstd, a Parquet file without
its footer, an Arrow stream without its end marker, text that is not UTF-8) always raises: a
dataset is never built from part of a file.

`iter_file_records` reads one input and yields `(record number, text)`; `(index of the file in
expand_inputs(...), record number)` identifies a document stably. The record number is the JSONL
line number, the Parquet / Arrow row number, 1 for a `.txt` file read whole and the line number
of a block's first line with `blank-line`.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from segpack.text import arrow_inputs
from segpack.text.input_errors import InputFormatError, ReadCounters

__all__ = ["InputFormatError", "ReadCounters", "SUFFIXES", "describe_inputs", "expand_inputs",
           "is_chat", "iter_documents", "iter_file_records", "kind_of"]

_TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_ARROW_SUFFIXES = (".parquet",)
# What `--input` files and directories may hold (`.arrow` files come from `hf-disk:` only).
SUFFIXES = _TEXT_SUFFIXES + _JSONL_SUFFIXES + _ARROW_SUFFIXES
_READ_BYTES = 1 << 20
_SKIP_HINT = "(pass skip_bad_lines=True (--skip-bad-lines) to count and skip such records)"


class _CorruptStream(Exception):
  """A compressed stream that cannot be read to its end (turned into an InputFormatError)."""


def kind_of(path: Path) -> str:
  """The file type of an input as the summaries count it: its supported suffix (`.jsonl.gz`),
  `.arrow`, else its last suffix (`.rst`), or `(no extension)`."""
  for suffix in SUFFIXES + (".arrow",):
    if path.name.endswith(suffix):
      return suffix
  return path.suffix or "(no extension)"


def _counted(counts: dict[str, int], what: str) -> str:
  """`".rst 14 files, .py 1 file"` of `{kind: count}` (`what` = "file")."""
  return ", ".join(f"{kind} {n:,} {what}{'s' if n != 1 else ''}".lstrip()
                   for kind, n in counts.items())


def describe_inputs(files: Sequence[Path], skipped: collections.Counter[str] | None = None,
                    documents: collections.Counter[str] | None = None) -> str:
  """One line: the files read by type (with their documents when counted) and the files of the
  input directories that were not read, by type.

  Example: `read .txt 1 file (1 document); not read: .rst 14 files (not an input type: ...)`.
  """
  read = collections.Counter(kind_of(p) for p in files)
  parts = []
  for kind, n in read.items():
    docs = "" if documents is None else f" ({_counted({'': documents[kind]}, 'document')})"
    parts.append(f"{_counted({kind: n}, 'file')}{docs}")
  line = "read " + (", ".join(parts) or "no files")
  if skipped:
    line += (f"; not read: {_counted(skipped, 'file')} in the input directories (not an input "
             f"type: {', '.join(SUFFIXES)})")
  return line


def expand_inputs(paths: Sequence[str | os.PathLike[str]], *,
                  skipped: collections.Counter[str] | None = None) -> list[Path]:
  """Input files in order: a directory contributes its supported files, sorted by path;
  `hf-disk:PATH` its Arrow files in the order of its `state.json`.

  Args:
    paths: the `--input` paths.
    skipped: counts, by `kind_of`, the files of the directories that are not read.
  """
  files = []
  skipped = skipped if skipped is not None else collections.Counter()
  for raw in paths:
    if os.fspath(raw).startswith(arrow_inputs.HF_DISK_PREFIX):
      files.extend(arrow_inputs.hf_disk_files(os.fspath(raw)))
      continue
    path = Path(raw)
    if path.is_dir():
      every = sorted(p for p in path.rglob("*") if p.is_file())
      found = [p for p in every if p.name.endswith(SUFFIXES)]
      others = collections.Counter(kind_of(p) for p in every if not p.name.endswith(SUFFIXES))
      if not found:
        raise InputFormatError(
            f"input {str(path)!r} (inputs, --input): directory holds no "
            f"{', '.join(SUFFIXES)} files"
            + (f" (it holds {_counted(others, 'file')})" if others else " (it holds no files)"))
      skipped.update(others)
      files.extend(found)
    elif not path.exists():
      raise InputFormatError(f"input {str(path)!r} (inputs, --input): no such file or "
                             f"directory")
    elif not path.name.endswith(SUFFIXES):
      raise InputFormatError(f"input {str(path)!r} (inputs, --input): unsupported file type "
                             f"(expected {', '.join(SUFFIXES)}, a directory or hf-disk:PATH)")
    else:
      files.append(path)
  return files


def _zstd_chunks(f, path: Path) -> Iterator[bytes]:
  """The decompressed bytes of a zstd file (frames one after another); a stream that ends
  inside a frame raises `_CorruptStream`, so a truncated file never reads as a shorter one."""
  try:
    import zstandard  # optional: only .zst inputs need it (the `segpack[zstd]` extra)
  except ImportError as e:
    raise InputFormatError(f"{path}: reading .zst files needs the zstandard package: pip install "
                           f"'segpack[zstd]'") from e
  dctx = zstandard.ZstdDecompressor()
  dobj, fed = dctx.decompressobj(), False
  try:
    while data := f.read(_READ_BYTES):
      while data:
        fed = True
        out = dobj.decompress(data)
        if out:
          yield out
        if not dobj.eof:
          break
        data, dobj, fed = dobj.unused_data, dctx.decompressobj(), False
  except zstandard.ZstdError as e:
    raise _CorruptStream(f"zstd: {e}") from e
  if fed:
    raise _CorruptStream("the zstd stream ends inside a frame: truncated")


def _split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
  """Lines (each with its b"\\n", the last maybe without) of a stream of byte chunks."""
  tail: list[bytes] = []
  for chunk in chunks:
    parts = chunk.split(b"\n")
    if len(parts) == 1:
      tail.append(chunk)
      continue
    yield b"".join(tail) + parts[0] + b"\n"
    for part in parts[1:-1]:
      yield part + b"\n"
    tail = [parts[-1]]
  last = b"".join(tail)
  if last:
    yield last


def _raw_lines(path: Path) -> Iterator[bytes]:
  if path.name.endswith((".gz", ".zst")) and path.stat().st_size == 0:
    # Even empty text compresses to a few bytes; an empty file was cut off or never written.
    raise _CorruptStream("the file is empty: no compressed data, not even an empty stream")
  if path.name.endswith(".gz"):
    with gzip.open(path, "rb") as f:
      yield from f
  elif path.name.endswith(".zst"):
    with open(path, "rb") as f:
      yield from _split_lines(_zstd_chunks(f, path))
  else:
    with open(path, "rb") as f:
      yield from f


def _span_lines(path: Path, start: int, end: int) -> Iterator[bytes]:
  """The lines of a plain file that start in bytes `[start, end)` (`start` begins a line)."""
  with open(path, "rb") as f:
    f.seek(start)
    left = end - start
    while left > 0:
      line = f.readline()
      if not line:
        return
      left -= len(line)
      yield line


def _numbered_lines(path: Path, span: tuple[int, int, int] | None = None
                    ) -> Iterator[tuple[int, bytes]]:
  """(line number, line) pairs of a (maybe compressed) file, or of the lines in bytes
  `[span[0], span[1])` of a plain one, numbered from `span[2]`; a file that cannot be read to
  its end (corrupt or truncated gzip / zstd, an I/O error) becomes an InputFormatError."""
  first = 1 if span is None else span[2]
  lineno = first - 1
  lines = _raw_lines(path) if span is None else _span_lines(path, span[0], span[1])
  try:
    for lineno, raw in enumerate(lines, start=first):
      yield lineno, raw
  except (OSError, EOFError, zlib.error, _CorruptStream) as e:
    raise InputFormatError(f"{path}: unreadable after line {lineno} ({type(e).__name__}: {e})"
                           ) from e


def _decode_utf8(path: Path, data: bytes, first_line: int) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = first_line + data.count(b"\n", 0, e.start)
    raise InputFormatError(f"{path}: not UTF-8 text at line {line} ({e.reason}, byte "
                           f"{e.start}): {data[max(0, e.start - 20):e.start + 20]!r}") from e


def _read_txt(path: Path, doc_separator: str) -> Iterator[tuple[int, str]]:
  if doc_separator == "file":
    yield 1, _decode_utf8(path, b"".join(raw for _, raw in _numbered_lines(path)), 1)
    return
  block: list[str] = []
  first = 0
  for lineno, raw in _numbered_lines(path):
    line = _decode_utf8(path, raw, lineno)
    if line.strip():
      first = first if block else lineno
      block.append(line)
    elif block:
      yield first, "".join(block)
      block = []
  if block:
    yield first, "".join(block)


def _short(value: Any) -> str:
  """The repr of `value`, cut to about 80 characters (of a long string, only its start)."""
  text = repr(value[:80] if isinstance(value, (str, bytes)) else value)
  return text if len(text) <= 80 else text[:77] + "..."


def _text_of(value: Any, what: str) -> tuple[str | None, str | None]:
  """(text, None) for a usable value, else (None, what is wrong with it)."""
  if isinstance(value, bytes):
    try:
      value = value.decode("utf-8")
    except UnicodeDecodeError as e:
      return None, (f"{what} is not UTF-8 ({e.reason}, byte {e.start}): "
                    f"{value[max(0, e.start - 20):e.start + 20]!r}")
  if value is None:
    return None, f"{what} is null"
  if not isinstance(value, str):
    return None, f"{what} is {type(value).__name__}, not a string: {_short(value)}"
  return value, None


def _blank(raw: bytes) -> bool:
  """Whether a line is empty or ASCII whitespace only (`not raw.strip()`, without the copy)."""
  return not raw or raw.isspace()


def _json_problem(raw: bytes, text_field: str) -> tuple[str | None, str | None]:
  """(text, None) for a JSONL line whose `text_field` is usable, else (None, the problem)."""
  try:
    record = json.loads(raw)
  except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, deep nesting.
    return None, f"not JSON ({type(e).__name__}: {str(e)[:200]}): {_short(raw)}"
  if not isinstance(record, dict) or text_field not in record:
    found = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
    return None, f"no field {text_field!r} (found: {found})"
  text, problem = _text_of(record[text_field], f"field {text_field!r}")
  # Only a JSON escape can give an unpaired surrogate, and an ASCII text holds none.
  if text is not None and not text.isascii() and b"\\u" in raw:
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      return None, (f"field {text_field!r} holds an unpaired surrogate (character {e.start}): "
                    f"{_short(text[max(0, e.start - 20):e.start + 20])}")
  return text, problem


def _kept(path: Path, checked: Iterator[tuple[int, str | None, str | None]], where: str,
          skip_bad_lines: bool, counters: ReadCounters) -> Iterator[tuple[int, str]]:
  """(number, text) of the good records of `checked` = (number, text, problem); a bad one is
  counted with `skip_bad_lines`, else raised as `{path}:{where}: {problem}`."""
  for number, text, problem in checked:
    if problem is None:
      yield number, text
    elif skip_bad_lines:
      counters.bad_lines += 1
    else:
      raise InputFormatError(f"{path}:{where.format(number)}: {problem} {_SKIP_HINT}")


def _read_jsonl(path: Path, text_field: str, skip_bad_lines: bool, counters: ReadCounters,
                span: tuple[int, int, int] | None = None) -> Iterator[tuple[int, str]]:
  checked = ((lineno, *_json_problem(raw, text_field))
             for lineno, raw in _numbered_lines(path, span) if not _blank(raw))
  return _kept(path, checked, "{}", skip_bad_lines, counters)


def _read_arrow(path: Path, text_field: str, skip_bad_lines: bool,
                counters: ReadCounters) -> Iterator[tuple[int, str]]:
  if path.name.endswith(".parquet"):
    values = arrow_inputs.parquet_values(path, text_field=text_field)
  else:
    values = arrow_inputs.arrow_stream_values(path, text_field=text_field)
  checked = ((row, *_text_of(value, f"column {text_field!r}")) for row, value in values)
  return _kept(path, checked, " row {}", skip_bad_lines, counters)


def iter_file_records(
    path: str | os.PathLike[str], *, doc_separator: str = "file", text_field: str = "text",
    skip_bad_lines: bool = False, counters: ReadCounters | None = None,
    span: tuple[int, int, int] | None = None,
) -> Iterator[tuple[int, str]]:
  """`(record number, text)` of every document of ONE input file (see the module docstring).

  Args:
    path: a file of `expand_inputs(...)`: `.txt[.gz|.zst]`, `.jsonl[.gz|.zst]`, `.parquet`, or
      an Arrow stream file of a `save_to_disk` directory (`.arrow`).
    doc_separator: `.txt`: "file" (a file is a document) or "blank-line".
    text_field: JSONL: the field holding the text; Parquet / Arrow: the column.
    skip_bad_lines: count unusable records in `counters` and go on, instead of raising
      InputFormatError (a file that cannot be read to its end raises all the same).
    counters: where skipped records are counted.
    span: `(start, end, first line)`: only the lines that start in bytes `[start, end)` of a
      plain `.jsonl` file (`start` begins a line), numbered from `first line`
      (`segpack.text.input_ranges` hands such parts of a file to worker processes).

  Yields:
    `(record number, text)`: the record number is 1-based within the file and increases; texts
    may be empty (the shard writer counts and skips those).
  """
  if doc_separator not in ("file", "blank-line"):
    raise InputFormatError(f"doc_separator (--doc-separator) must be 'file' or 'blank-line', "
                           f"got {doc_separator!r}")
  path = Path(path)
  counters = counters if counters is not None else ReadCounters()
  if span is not None:
    if not path.name.endswith(".jsonl"):
      raise InputFormatError(f"{path}: only a plain .jsonl file is read by byte ranges")
    yield from _read_jsonl(path, text_field, skip_bad_lines, counters, span)
  elif path.name.endswith(_TEXT_SUFFIXES):
    yield from _read_txt(path, doc_separator)
  elif path.name.endswith(_JSONL_SUFFIXES):
    yield from _read_jsonl(path, text_field, skip_bad_lines, counters)
  elif path.name.endswith(_ARROW_SUFFIXES + (".arrow",)):
    yield from _read_arrow(path, text_field, skip_bad_lines, counters)
  else:
    raise InputFormatError(f"{path}: unsupported file type (expected {', '.join(SUFFIXES)} or "
                           f".arrow)")


def iter_documents(
    files: Sequence[Path], *, doc_separator: str = "file", text_field: str = "text",
    skip_bad_lines: bool = False, counters: ReadCounters | None = None,
    documents: collections.Counter[str] | None = None,
) -> Iterator[str]:
  """The documents of `files`, in order: `iter_file_records` of each, without record numbers.

  Args:
    files: input files (`expand_inputs` turns CLI paths into these).
    doc_separator, text_field, skip_bad_lines, counters: as for `iter_file_records`.
    documents: counts, by `kind_of` the file, the documents that hold text (not empty).

  Yields:
    Document texts (possibly empty: the writer counts and skips those).
  """
  counters = counters if counters is not None else ReadCounters()
  if doc_separator not in ("file", "blank-line"):
    raise InputFormatError(f"doc_separator (--doc-separator) must be 'file' or 'blank-line', "
                           f"got {doc_separator!r}")
  for path in files:
    kind = kind_of(path)
    for _, text in iter_file_records(path, doc_separator=doc_separator, text_field=text_field,
                                     skip_bad_lines=skip_bad_lines, counters=counters):
      if documents is not None and text:
        documents[kind] += 1
      yield text


def is_chat(files: Sequence[Path], input_format: str, *, text_field: str,
             messages_field: str) -> bool:
  """Whether the inputs are chat conversations (`--format auto`: the first JSONL record has
  `messages_field` and no `text_field`)."""
  if input_format not in ("auto", "text", "chat"):
    raise InputFormatError(f"input_format (--format) must be auto, text or chat, got "
                           f"{input_format!r}")
  if input_format != "auto":
    if input_format == "chat" and any(not p.name.endswith((".jsonl", ".jsonl.gz"))
                                      for p in files):
      raise InputFormatError(f"input_format='chat' (--format) reads .jsonl[.gz] files only, "
                             f"got {[str(p) for p in files]}")
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
  except (OSError, EOFError, zlib.error, ValueError, RecursionError):
    return False  # The text reader reports what is wrong with the file.
  return False

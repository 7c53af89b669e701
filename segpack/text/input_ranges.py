"""Input files cut into parts that `segpack tokenize`'s worker processes read themselves.

With worker processes, the main process would otherwise read and parse every record and send
every text to a worker, work that competes with the encoding on a machine whose every core
encodes. `RangedInputs` hands the workers parts of the files instead:

- a plain `.jsonl` file goes in runs of whole lines of about `RANGE_BYTES`: the main process
  reads each block once, cuts it after its last newline and counts its lines, for the line
  numbers that errors name; a `.txt` file read as one document (`--doc-separator file`) is one
  part; consecutive parts are grouped into jobs of about `RANGE_BYTES`;
- a worker reads a part through `iter_file_records` (with `span=` for a `.jsonl` part): the
  rules of every reader, so the same documents, the same errors naming the file and line, the
  same records skipped and counted with `--skip-bad-lines` (`read_job`);
- the main process takes the jobs' results in input order, adds what they read to the run's
  counts as `iter_documents` would (`account`: documents with text by file type, skipped
  records), and calls `at_end` after the last one, where inputs without a document are refused.

Other inputs (compressed files, Parquet, `hf-disk:`, `.txt` files split at blank lines) are read
in the main process, and so is every input of a run in one process or of one that resumes after
kept shards: iterating a `RangedInputs` gives the texts read here (`iter_documents`), then calls
`at_end`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from segpack.text.inputs import ReadCounters, iter_file_records, kind_of

__all__ = ["RANGE_BYTES", "JobResult", "RangedInputs", "Span", "read_job"]

# Bytes of input per part and per job.
RANGE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Span:
  """A part of one input: lines starting in bytes `[start, end)` numbered from `first_line` (a
  `.jsonl` file), or the whole file (`end` -1)."""

  path: str
  start: int
  end: int
  first_line: int


@dataclasses.dataclass(frozen=True)
class JobResult:
  """What a worker read from a job: its texts, their UTF-8 bytes, documents with text by file
  type, records skipped."""

  texts: list[str]
  text_bytes: int
  documents: dict[str, int]
  bad_lines: int


def _utf8_size(text: str) -> int:
  return len(text) if text.isascii() else len(text.encode("utf-8"))


def read_job(job: tuple[Span, ...], read: dict[str, Any]) -> JobResult:
  """The texts of a job's parts, in order (`read`: the reading flags of `iter_documents`)."""
  counters = ReadCounters()
  texts: list[str] = []
  documents: collections.Counter[str] = collections.Counter()
  for span in job:
    whole = span.end < 0
    records = iter_file_records(
        span.path, counters=counters, span=None if whole else (span.start, span.end,
                                                               span.first_line), **read)
    first = len(texts)
    texts.extend(text for _, text in records)
    documents[kind_of(Path(span.path))] += sum(1 for t in texts[first:] if t)
  return JobResult(texts=texts, text_bytes=sum(map(_utf8_size, texts)),
                   documents=dict(documents), bad_lines=counters.bad_lines)


class RangedInputs:
  """The documents of input files, for the main process or in parts for workers (module
  docstring).

  Args:
    files: the input files, in order.
    read: the reading flags (`doc_separator`, `text_field`, `skip_bad_lines`).
    counters: where skipped records are counted.
    documents: where the documents with text are counted, by file type.
    here: the texts read in this process (`iter_documents` of `files`, counting into
      `counters` and `documents`).
    at_end: called once every input was read (it may raise, before a manifest is written).
  """

  def __init__(self, files: Sequence[Path], *, read: dict[str, Any], counters: ReadCounters,
               documents: collections.Counter[str], here: Callable[[], Iterable[str]],
               at_end: Callable[[], None]):
    self.files = list(files)
    self.read = dict(read)
    self.counters = counters
    self.documents = documents
    self.here = here
    self.at_end = at_end

  def __iter__(self) -> Iterator[str]:
    yield from self.here()
    self.at_end()

  @property
  def by_parts(self) -> bool:
    """Whether workers can read every input (plain `.jsonl`, `.txt` read whole)."""
    whole_txt = self.read.get("doc_separator", "file") == "file"
    return all(p.name.endswith(".jsonl") or (whole_txt and p.name.endswith(".txt"))
               for p in self.files)

  def jobs(self) -> Iterator[tuple[Span, ...]]:
    """The parts of every input in order, grouped into jobs of about `RANGE_BYTES`."""
    job: list[Span] = []
    size = 0
    for span, nbytes in self._spans():
      job.append(span)
      size += nbytes
      if size >= RANGE_BYTES:
        yield tuple(job)
        job, size = [], 0
    if job:
      yield tuple(job)

  def _spans(self) -> Iterator[tuple[Span, int]]:
    for path in self.files:
      if not path.name.endswith(".jsonl"):
        yield Span(str(path), 0, -1, 1), path.stat().st_size
        continue
      yield from _jsonl_spans(path)

  def account(self, result: JobResult) -> None:
    """Adds a job's counts to the run's."""
    self.counters.bad_lines += result.bad_lines
    self.documents.update(result.documents)


def _jsonl_spans(path: Path) -> Iterator[tuple[Span, int]]:
  """Runs of whole lines of about `RANGE_BYTES` of a plain `.jsonl` file, with their bytes."""
  start, line = 0, 1
  with open(path, "rb") as f:
    while True:
      block = f.read(RANGE_BYTES)
      if not block:
        return
      cut = block.rfind(b"\n")
      while cut < 0:  # a line longer than a block: read on to its end (or the file's)
        more = f.read(RANGE_BYTES)
        if not more:
          cut = len(block) - 1
          break
        block += more
        cut = block.rfind(b"\n")
      end = start + cut + 1
      yield Span(str(path), start, end, line), end - start
      line += block.count(b"\n", 0, cut + 1)
      f.seek(end)
      start = end

"""Inputs read by the workers themselves (`segpack.text.input_ranges`): the parts cover every line
once with its line number, and a run whose workers read the files gives what a run reading them
in its main process gives: the same shards, counts and summary, or the same one-line error."""

import gzip
import json

import pytest

from segpack.bench.tokenize import same_bytes
from segpack.text import dataset, input_ranges, inputs


def _lines(records):
  return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def test_parts_cover_every_line_once_with_its_number(tmp_path, monkeypatch):
  monkeypatch.setattr(input_ranges, "RANGE_BYTES", 64)
  records = [{"text": "a" * n} for n in (3, 10, 200, 0, 40, 7, 150, 1, 90)]
  body = _lines(records[:3]) + "\n   \n" + _lines(records[3:]) + json.dumps({"text": "last"})
  path = tmp_path / "in.jsonl"
  path.write_text(body)  # a blank line, a line of spaces, a line longer than a part, no final \n
  spans = [s for job in input_ranges.RangedInputs(
      [path], read={}, counters=inputs.ReadCounters(), documents=None, here=list,
      at_end=list).jobs() for s in job]
  assert len(spans) > 4 and spans[0].start == 0 and spans[-1].end == path.stat().st_size
  assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
  assert all(s.start == 0 or body.encode()[s.start - 1:s.start] == b"\n" for s in spans)
  whole = list(inputs.iter_file_records(path))
  parts = [r for s in spans
           for r in inputs.iter_file_records(path, span=(s.start, s.end, s.first_line))]
  assert parts == whole and whole[-1] == (12, "last") and len(whole) == 10


def _run(files, out, model, workers, **kw):
  try:
    (summary,) = dataset.tokenize_files(files, out, spm_model=model, workers=workers,
                                        shard_tokens=500, **kw)
  except inputs.InputFormatError as e:
    return str(e)
  return (summary.documents, summary.tokens, summary.skipped_empty, summary.bad_lines)


CASES = {
    "fine": ([{"text": "one two"}, {"text": ""}, {"text": "déjà 🙂"}] * 40, {}),
    "not json": ([{"text": "x y"}] * 30 + ["{broken"] + [{"text": "z"}] * 30, {}),
    "no field": ([{"text": "x y"}] * 50 + [{"body": "z"}], {}),
    "skipped": ([{"text": "x y"}] * 20 + ["{broken", {"text": 5}, {"text": None}] * 9,
                {"skip_bad_lines": True}),
    "surrogate": ([{"text": "x y"}] * 40 + ['{"text": "bad \\ud800 here"}'], {}),
    "only empty": ([{"text": ""}] * 30, {}),
    "other field": ([{"body": "x y " * k} for k in range(60)], {"text_field": "body"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_workers_reading_give_what_the_main_process_gives(tmp_path, model, monkeypatch, case):
  monkeypatch.setattr(input_ranges, "RANGE_BYTES", 300)  # many parts and jobs
  records, kw = CASES[case]
  first = tmp_path / "a.jsonl"
  first.write_text(_lines([{"text": "first file", "body": "first body"}] * 3 + records))
  notes = tmp_path / "b.txt"
  notes.write_text("a text file, read whole\n\nby one worker")
  files = [first, notes] if case != "only empty" else [first]
  if case == "only empty":
    first.write_text(_lines(records))
  one = _run(files, tmp_path / "one", model, 1, **kw)
  two = _run(files, tmp_path / "two", model, 2, **kw)
  assert one == two
  if isinstance(one, str):
    assert str(first) in one or "no documents" in one
    assert not (tmp_path / "two" / "manifest.json").exists()
  else:
    assert same_bytes(tmp_path / "one", tmp_path / "two")
  if case == "not json":
    assert f"{first}:34: not JSON" in one  # the line number of the whole file
  if case == "skipped":
    assert one[3] == 27


def test_other_inputs_are_read_in_the_main_process(tmp_path, model, monkeypatch):
  monkeypatch.setattr(input_ranges, "RANGE_BYTES", 300)
  plain = tmp_path / "a.jsonl"
  plain.write_text(_lines([{"text": f"document {k}"} for k in range(50)]))
  packed = tmp_path / "b.jsonl.gz"
  packed.write_bytes(gzip.compress(_lines([{"text": f"more {k}"} for k in range(50)]).encode()))
  ranged = input_ranges.RangedInputs([plain, packed], read={}, counters=None, documents=None,
                                     here=list, at_end=list)
  assert not ranged.by_parts
  assert input_ranges.RangedInputs([plain], read={"doc_separator": "blank-line"}, counters=None,
                                   documents=None, here=list, at_end=list).by_parts
  blank = input_ranges.RangedInputs([tmp_path / "c.txt"], read={"doc_separator": "blank-line"},
                                    counters=None, documents=None, here=list, at_end=list)
  assert not blank.by_parts
  one = _run([plain, packed], tmp_path / "one", model, 1)
  two = _run([plain, packed], tmp_path / "two", model, 2)
  assert one == two == (100, one[1], 0, 0)
  assert same_bytes(tmp_path / "one", tmp_path / "two")

"""Tokenizing on Apache Beam: `segpack tokenize --runner beam` (docs/ingest.md, segpack[beam]).

The same inputs and the same shard format (docs/format.md) as the local path
(`encode.write_dataset`), written by a Beam pipeline, so that a cluster (Dataflow, Flink) can
tokenize what one machine cannot.

Algorithm:
  1. Ids: every document has a stable id (input index, record number), the record number counting
     the documents of one input (0, 1, ...) in the order `inputs.iter_file_records` yields them
     (lines without a document, and bad lines skipped with `skip_bad_lines`, take no number). A
     *unit* is `unit_records` consecutive records of one input: unit (f, b) holds records
     [b * unit_records, (b + 1) * unit_records) of input f.
  2. Read: each input file is read whole by one worker (`inputs.iter_file_records`), which emits
     ((f, b), (record, text)). The built-in corpus is read by the driver (it is the driver's own
     Python) and enters the pipeline as data, as one input.
  3. Per unit, after a GroupByKey: sort by record number (and check they are exactly the unit's
     records, once each), tokenize with the tokenizer rebuilt from its spec once per worker
     process, split into shards by the local rule (a shard closes once it holds `shard_tokens`
     tokens), write each file under a name derived from the unit (`shard-FFFFF-BBBBB-SSSSS.tokens`
     and `.offsets`) through a temporary file and a rename (at a URL, `gs://`, `s3://`, ...: one
     upload under the final name, `segpack.remote_files`), then the unit's done-record
     `shard-FFFFF-BBBBB.done.json` (the unit's shards, counts and checksums); then reads the
     files back and checks their sizes and checksums. A retried or duplicated bundle writes the
     same names with the same bytes: no duplicate, and nothing half-written under a final name.
  4. One final step, after a `ToList` barrier, orders the units by id, checks that every input's
     units are contiguous and full (all but its last), checks every listed file's size in one
     listing, writes the manifest last (the keys `ShardWriter` writes, `metadata_sha256` too) and
     removes the done-records.

The dataset's order is the ids' order whatever the runner and the number of workers, so its
documents equal the local path's document for document; only the shard boundaries differ (a shard
never spans two units). A rerun with the same inputs and settings keeps the units whose
done-records match (resume key, dtype, checksums), reads past their records and redoes the rest;
over a finished dataset it checks the files and changes nothing (`beam_driver.finished_manifest`),
unless `overwrite` asks for a rebuild.

Example: 2 inputs of 5 and 2 documents, `unit_records=2`: units (0, 0) (0, 1) (0, 2) (1, 0), and
the dataset holds input 0's documents 0..4, then input 1's 0..1, empty ones skipped and counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segpack import remote_files
from segpack import shards as shards_lib
from segpack.errors import ArgumentError
from segpack.shards.format import OFFSET_DTYPE, OWNED_FILE, metadata_sha256
from segpack.shards.record import stored_metadata
from segpack.text import corpus
from segpack.text import encode
from segpack.text.beam import driver as beam_driver
from segpack.text.beam import remote_inputs
from segpack.text.beam.driver import ERRORS_FILE, unit_names
from segpack.text.beam.remote_inputs import iter_remote_records
from segpack.text.inputs import InputFormatError, ReadCounters
from segpack.text.tokenizers import spec as tokenizer_spec

__all__ = ["DEFAULT_UNIT_RECORDS", "ERRORS_FILE", "builtin_splits_beam", "tokenize_files_beam",
           "unit_names", "write_dataset_beam"]

DEFAULT_UNIT_RECORDS = 10_000
# Tokenizers rebuilt in this worker process, by spec (filled on first use, never at import).
_TOKENIZERS: dict[str, tokenizer_spec.Tokenizer] = {}


def _json_bytes(obj: Any) -> bytes:
  """`obj` as `files.atomic_write_json` writes it (indented, keys sorted, a final newline)."""
  return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")


def _count(name: str, value: int) -> None:
  """Adds `value` to the Beam counter `segpack/name` (read by the driver for its summary)."""
  from apache_beam.metrics import Metrics  # optional: runs only inside a Beam pipeline
  Metrics.counter(beam_driver.METRICS_NAMESPACE, name).inc(value)


def _tokenizer(spec: str, fingerprint: str) -> tokenizer_spec.Tokenizer:
  """The tokenizer of `spec`, built once per worker process; it must have the driver's
  fingerprint."""
  tok = _TOKENIZERS.get(spec)
  if tok is None:  # A tokenizer file named by URL is copied to this machine first.
    tok = _TOKENIZERS[spec] = tokenizer_spec.from_spec(remote_inputs.local_tokenizer_spec(spec))
  if tok.fingerprint != fingerprint:
    raise ArgumentError(f"tokenizer {spec!r} on this worker has fingerprint {tok.fingerprint}, the "
                     f"driver's has {fingerprint}: every worker must see the same file")
  return tok


# -------------------------------------------------------------------------------------------------
# The pipeline's steps (plain functions: they pickle by reference to the workers).


_ERRORS = "errors"  # The Read step's output of bad inputs: (input index, message).


def _read_input(item: tuple[int, str], *, read: dict[str, Any], unit_records: int,
                kept: frozenset[tuple[int, int]]) -> Iterator[tuple[tuple[int, int],
                                                                tuple[int, str]]]:
  """((f, b), (record, text)) for the documents of input `item = (f, path)` outside kept units."""
  index, path = item
  counters = ReadCounters()
  try:
    for record, (_, text) in enumerate(iter_remote_records(path, counters=counters, **read)):
      unit = (index, record // unit_records)
      if unit not in kept:
        yield unit, (record, text)
  except InputFormatError as e:  # To the driver as data: a raised error is logged with a trace.
    from apache_beam import pvalue  # optional: segpack[beam]
    yield pvalue.TaggedOutput(_ERRORS, (index, str(e)))
    return
  _count("bad_lines", counters.bad_lines)


def _shard_record(output: str, stem: str, docs: list[np.ndarray], dtype: np.dtype,
                  vocab_size: int) -> dict[str, Any]:
  """Writes one shard (`stem.offsets`, then `stem.tokens`, each whole under its final name);
  its manifest entry."""
  token_ids = np.concatenate(docs)
  if int(token_ids.max()) >= vocab_size:
    raise ArgumentError(f"{remote_files.join(output, stem)}: token id {int(token_ids.max())} >= "
                     f"vocab_size {vocab_size}")
  tokens = token_ids.astype(dtype, copy=False).tobytes()
  ends = np.cumsum([d.size for d in docs])
  offsets = np.concatenate([[0], ends]).astype(OFFSET_DTYPE).tobytes()
  remote_files.write_bytes(remote_files.join(output, f"{stem}.offsets"), offsets)
  remote_files.write_bytes(remote_files.join(output, f"{stem}.tokens"), tokens)
  return {"tokens": f"{stem}.tokens", "offsets": f"{stem}.offsets", "num_documents": len(docs),
          "num_tokens": int(ends[-1]), "sha256": {"tokens": hashlib.sha256(tokens).hexdigest(),
                                                  "offsets": hashlib.sha256(offsets).hexdigest()}}


def _write_unit(element: tuple[tuple[int, int], Sequence[tuple[int, str]]], *, output: str,
                spec: str, fingerprint: str, shard_tokens: int, unit_records: int,
                resume_key: str) -> dict[str, Any]:
  """Tokenizes one unit into its shards and done-record; returns the done-record."""
  (index, block), values = element
  values = sorted(values)
  records = [r for r, _ in values]
  first = block * unit_records
  if records != list(range(first, first + len(records))) or len(records) > unit_records:
    raise RuntimeError(f"unit ({index}, {block}) got records {records[:5]}...{records[-5:]}, "
                       f"expected {first}.. once each")
  out = output
  tok = _tokenizer(spec, fingerprint)
  texts = [t for _, t in values]
  shards, docs, size, skipped = [], [], 0, 0
  for doc in tok.encode_batch(texts):
    if doc.size == 0:
      skipped += 1
      continue
    docs.append(doc)
    size += doc.size
    if size >= shard_tokens:
      shards.append(_shard_record(out, unit_names(index, block, len(shards)), docs, tok.dtype,
                                  tok.vocab_size))
      docs, size = [], 0
  if docs:
    shards.append(_shard_record(out, unit_names(index, block, len(shards)), docs, tok.dtype,
                                tok.vocab_size))
  record = {"unit": [index, block], "resume_key": resume_key, "dtype": np.dtype(tok.dtype).name,
            "inputs": len(values), "skipped_empty": skipped, "shards": shards}
  remote_files.write_bytes(remote_files.join(out, f"{unit_names(index, block)}.done.json"),
                           _json_bytes(record))
  _count("text_bytes", sum(len(t.encode("utf-8")) for t in texts))
  return record


def _check_units(records: list[dict[str, Any]], unit_records: int) -> None:
  """Every input's units are 0, 1, ..., each once, all full but the last."""
  by_input: dict[int, list[dict[str, Any]]] = {}
  for r in records:
    by_input.setdefault(r["unit"][0], []).append(r)
  for index, units in by_input.items():
    blocks = [r["unit"][1] for r in units]
    if blocks != list(range(len(blocks))):
      raise RuntimeError(f"input {index}: units {blocks[:10]} are not 0, 1, ... once each")
    short = [r["unit"][1] for r in units[:-1] if r["inputs"] != unit_records]
    if short:
      raise RuntimeError(f"input {index}: units {short[:10]} hold fewer than {unit_records} "
                         f"records but are not the input's last")


def _expected_sizes(shard: dict[str, Any], dtype: np.dtype) -> dict[str, int]:
  """File name -> size in bytes of one shard's manifest entry."""
  return {shard["tokens"]: shard["num_tokens"] * np.dtype(dtype).itemsize,
          shard["offsets"]: (shard["num_documents"] + 1) * OFFSET_DTYPE.itemsize}


def _check_unit(record: dict[str, Any], *, output: str) -> dict[str, Any]:
  """Reads a written unit's files back: each must have its size and checksum (an upload that
  went wrong stops the run here, before any manifest names it); returns the done-record."""
  for shard in record["shards"]:
    sizes = _expected_sizes(shard, record["dtype"])
    for kind in ("tokens", "offsets"):
      path = remote_files.join(output, shard[kind])
      data = remote_files.read_bytes(path)
      digest = hashlib.sha256(data).hexdigest()
      if len(data) != sizes[shard[kind]] or digest != shard["sha256"][kind]:
        raise RuntimeError(f"{path}: read back {len(data)} bytes with sha256 {digest}, written "
                           f"{sizes[shard[kind]]} bytes with sha256 {shard['sha256'][kind]}")
  return record


def _write_manifest(records: list[dict[str, Any]], *, output: str, header: dict[str, Any],
                    unit_records: int, errors: Sequence[tuple[int, str]] = ()) -> int:
  """The final step: checks that every unit's files are there with their sizes, writes the
  manifest of all units in id order (last: a reader trusts only a manifest), then removes the
  done-records and temporary files.

  With bad inputs (`errors`), no manifest: the errors are written to `ERRORS_FILE` instead, for
  the driver to raise the first one (in input order)."""
  if errors:
    remote_files.write_bytes(remote_files.join(output, ERRORS_FILE),
                             _json_bytes(sorted([list(e) for e in errors])))
    return 0
  records = sorted(records, key=lambda r: tuple(r["unit"]))
  _check_units(records, unit_records)
  shards = [s for r in records for s in r["shards"]]
  listed = {p.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]: size
            for p, size in remote_files.list_files(output).items()}
  for shard in shards:
    for name, size in _expected_sizes(shard, header["dtype"]).items():
      if listed.get(name) != size:
        raise RuntimeError(f"{remote_files.join(output, name)}: {listed.get(name)} bytes listed, "
                           f"{size} expected; no manifest written (rerun to redo the unit)")
  manifest = dict(header, num_documents=sum(s["num_documents"] for s in shards),
                  num_tokens=sum(s["num_tokens"] for s in shards),
                  skipped_empty=sum(r["skipped_empty"] for r in records),
                  inputs=sum(r["inputs"] for r in records), shards=shards)
  remote_files.write_bytes(remote_files.join(output, shards_lib.MANIFEST_NAME),
                           _json_bytes(manifest))
  done = {f"{unit_names(*r['unit'])}.done.json" for r in records}
  remote_files.delete([remote_files.join(output, name) for name in listed
                       if name in done or (name.endswith(".tmp") and OWNED_FILE.match(name))])
  return len(shards)


# -------------------------------------------------------------------------------------------------
# The driver (its checks of the output directory, Beam's import and options: beam_driver).


def write_dataset_beam(
    output: str | Path,
    *,
    tokenizer: tokenizer_spec.Tokenizer,
    worker_spec: str | None = None,
    resume_key: str,
    files_in: Sequence[str | Path] | None = None,
    documents: Sequence[str] | None = None,
    read: dict[str, Any] | None = None,
    shard_tokens: int,
    unit_records: int = DEFAULT_UNIT_RECORDS,
    beam_options: str = "",
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> tuple[dict[str, Any], int, int, int]:
  """Tokenizes `files_in` (or the in-memory `documents`) into a shard dataset with Beam.

  Args:
    output: dataset directory: a path every worker sees (local, NFS, a mounted bucket) or a URL
      of Beam's filesystems (`gs://`, `s3://`, `hdfs://`).
    tokenizer: carries `spec` (workers rebuild it with `tokenizer_spec.from_spec`), `fingerprint`,
      `vocab_size`, `dtype` and `describe()`.
    worker_spec: the spec workers rebuild the tokenizer from, when not `tokenizer.spec` (a spec
      naming a URL, which every worker copies to its machine).
    resume_key: identifies the inputs and settings (as in `encode.write_dataset`).
    files_in: input files (paths or URLs), each read whole by one worker with `read` options.
    documents: instead of files: the documents of one input (the built-in corpus).
    read: `iter_file_records` options (`doc_separator`, `text_field`, `skip_bad_lines`).
    shard_tokens: a shard closes once it holds this many tokens (shards never span units).
    unit_records: records per unit (the unit of parallelism, retry and resume).
    beam_options: Beam pipeline flags, as on a command line (`--runner=FlinkRunner ...`); none:
      Beam's FnApiRunner, as the DirectRunner runs a batch pipeline (`beam_driver.local_runner`).
    metadata: stored in the manifest, with `tokenizer` (`describe()`) and `runner` added.
    overwrite: rebuild the dataset, also a complete one with the same key; without it a complete
      dataset made with another key, or with an unreadable manifest or missing or damaged files,
      raises InputFormatError (`beam_driver.finished_manifest`).

  Returns:
    (manifest, shards kept from an earlier run, UTF-8 bytes tokenized, bad lines skipped).
  """
  if (files_in is None) == (documents is None):
    raise ArgumentError("write_dataset_beam: pass exactly one of files_in and documents")
  if not isinstance(unit_records, int) or unit_records < 1:
    raise InputFormatError(
        f"unit_records (--unit-records) must be a positive int, got {unit_records!r}")
  beam = beam_driver.import_beam()
  options = beam_driver.pipeline_options(beam_options)  # Also configures Beam's filesystems.
  output = str(output) if remote_files.is_url(output) else str(Path(output).resolve())
  dtype = np.dtype(tokenizer.dtype)
  finished = beam_driver.finished_manifest(output, resume_key, overwrite)
  if finished is not None:
    return finished, len(finished.get("shards", [])), 0, 0
  kept = beam_driver.clear_output(output, resume_key, dtype)
  header = {
      "format": shards_lib.FORMAT_NAME, "format_version": shards_lib.FORMAT_VERSION,
      "dtype": dtype.name, "byte_order": "little", "vocab_size": tokenizer.vocab_size,
      "tokenizer_fingerprint": tokenizer.fingerprint, "resume_key": resume_key,
      "metadata": stored_metadata(
          metadata, where=remote_files.join(output, shards_lib.MANIFEST_NAME),
          tokenizer=tokenizer.describe(), runner="beam", unit_records=unit_records)}
  # As `ShardWriter` writes it; also fails early when the metadata is not serialisable.
  header["metadata_sha256"] = metadata_sha256(json.loads(json.dumps(header["metadata"])))
  kept_units = frozenset(tuple(r["unit"]) for r in kept)
  pipeline = beam.Pipeline(runner=beam_driver.local_runner(options), options=options)
  if files_in is not None:
    items = [(i, str(p) if remote_files.is_url(p) else str(Path(p).resolve()))
             for i, p in enumerate(files_in)]
    read_out = (pipeline | "Inputs" >> beam.Create(items) | "Spread" >> beam.Reshuffle()
                | "Read" >> beam.FlatMap(_read_input, read=dict(read or {}),
                                         unit_records=unit_records, kept=kept_units
                                         ).with_outputs(_ERRORS, main="documents"))
    keyed, errors = read_out.documents, read_out[_ERRORS]
  else:
    keyed = pipeline | "Documents" >> beam.Create([
        ((0, r // unit_records), (r, t)) for r, t in enumerate(documents)
        if (0, r // unit_records) not in kept_units])
    errors = pipeline | "NoErrors" >> beam.Create([])
  written = (keyed | "Units" >> beam.GroupByKey()
             | "Tokenize" >> beam.Map(_write_unit, output=output,
                                      spec=worker_spec or tokenizer.spec,
                                      fingerprint=tokenizer.fingerprint,
                                      shard_tokens=shard_tokens, unit_records=unit_records,
                                      resume_key=resume_key)
             | "Check" >> beam.Map(_check_unit, output=output))
  _ = ((written, pipeline | "Kept" >> beam.Create(kept)) | "All" >> beam.Flatten()
       | "Barrier" >> beam.combiners.ToList()
       | "Manifest" >> beam.Map(_write_manifest, output=output, header=header,
                                unit_records=unit_records, errors=beam.pvalue.AsList(errors)))
  with beam_driver.quiet_step_errors():
    result = pipeline.run()
    state = result.wait_until_finish()
  if str(state).rsplit(".", 1)[-1] != "DONE":
    raise RuntimeError(f"Beam pipeline for {output} ended in state {state}")
  beam_driver.raise_input_errors(output)
  manifest = json.loads(remote_files.read_bytes(remote_files.join(output,
                                                                 shards_lib.MANIFEST_NAME)))
  return (manifest, sum(len(r["shards"]) for r in kept),
          beam_driver.read_counter(result, "text_bytes"),
          beam_driver.read_counter(result, "bad_lines"))


def tokenize_files_beam(files_in: Sequence[Path], output: Path, *,
                        tokenizer: tokenizer_spec.Tokenizer, read: dict[str, Any],
                        ident: dict[str, Any], metadata: dict[str, Any], shard_tokens: int,
                        unit_records: int, beam_options: str, overwrite: bool) -> encode.Summary:
  """`segpack tokenize --runner beam` on input files: `write_dataset_beam` and its summary."""
  start = time.perf_counter()
  key = encode.resume_key(dict(ident, tokenizer=tokenizer.fingerprint, shard_tokens=shard_tokens,
                               runner="beam", unit_records=unit_records))
  manifest, kept, nbytes, bad_lines = write_dataset_beam(
      output, tokenizer=tokenizer, resume_key=key, files_in=files_in, read=read,
      shard_tokens=shard_tokens, unit_records=unit_records, beam_options=beam_options,
      metadata=metadata, overwrite=overwrite)
  return encode.summarize(output, manifest, resumed=kept, bad_lines=bad_lines,
                          seconds=time.perf_counter() - start, text_bytes=nbytes)


def builtin_splits_beam(output: Path, size: str, tokenizer: tokenizer_spec.Tokenizer, *,
                        shard_tokens: int, unit_records: int, beam_options: str, progress: bool,
                        overwrite: bool) -> list[encode.Summary]:
  """Both splits of the built-in corpus into `output/train` and `output/eval`, with Beam.

  The driver enumerates the documents (`corpus.builtin_documents`: this Python's corpus, which a
  worker's Python may not share); the pipeline tokenizes and writes them.
  """
  summaries = []
  for split in ("train", "eval"):
    start = time.perf_counter()
    texts = [text for _, text in corpus.builtin_documents(split=split, size=size)]
    key = encode.resume_key({"builtin": corpus.corpus_key(size), "split": split,
                             "tokenizer": tokenizer.fingerprint, "shard_tokens": shard_tokens,
                             "runner": "beam", "unit_records": unit_records})
    manifest, kept, nbytes, _ = write_dataset_beam(
        output / split, tokenizer=tokenizer, resume_key=key, documents=texts,
        shard_tokens=shard_tokens, unit_records=unit_records, beam_options=beam_options,
        metadata={"source": f"builtin:{size}", "split": split, "python": sys.version},
        overwrite=overwrite)
    summaries.append(encode.summarize(output / split, manifest, resumed=kept, bad_lines=0,
                                      seconds=time.perf_counter() - start, text_bytes=nbytes))
    encode.say(progress, f"tokenized the {split} split with Beam: "
                         f"{manifest['num_documents']:,} documents, "
                         f"{manifest['num_tokens']:,} tokens in "
                         f"{time.perf_counter() - start:.1f} s")
  return summaries

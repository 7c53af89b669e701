"""`tokenize_files`: inputs to a shard dataset (what `segpack tokenize` runs).

The tokenizer is `--tokenizer spm:PATH | hf:PATH` (`tokenizer_spec.from_spec`), `--spm-model`
(the same as `spm:`), or a SentencePiece model trained first (`--vocab-size`). Plain text goes
through `encode.write_dataset` (worker processes, resumable); chat conversations
(`--format chat`, or detected) through `chat_files.write_chat_dataset` with a per-token loss mask,
rendered as `chat_template` (`--chat-template`, `CHAT_TEMPLATES`) says: `auto` the tokenizer's
own chat template when it has one, else segpack's; `own` the tokenizer's own (refused without
one); `segpack` segpack's `chat.ChatTemplate` even when the tokenizer has its own.
`builtin[:small]` is the built-in corpus (`corpus.py`), written as DIR/train and DIR/eval with the
SentencePiece model copied to DIR/spm.model. `runner="beam"` (`--runner beam`) writes plain text
and the built-in corpus with an Apache Beam pipeline instead (`beam_pipeline`, docs/ingest.md).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from segpack.files import LockHeldError, file_lock
from segpack.text.beam import pipeline as beam_pipeline
from segpack.text.chat import write as chat_write
from segpack.text.chat import prompts as prompts_write
from segpack.text.chat.preference import write as preference_write
from segpack.text import corpus
from segpack.text import encode
from segpack.text.chat import hf_chat
from segpack.text import input_ranges
from segpack.text.tokenizers import spm as spm_lib
from segpack.text.tokenizers import cache as tokenizer_cache
from segpack.text.tokenizers import spec as tokenizer_spec
from segpack.text.inputs import (
    InputFormatError, ReadCounters, describe_inputs, expand_inputs, is_chat, iter_documents)

__all__ = ["CHAT_TEMPLATES", "LOCK_NAME", "refuse_chat_template", "tokenize_files"]

# The values of `tokenize_files(chat_template=...)` (`--chat-template`); "auto" is the default.
CHAT_TEMPLATES = ("auto", "own", "segpack")

# Held by a local `segpack tokenize` run for its whole duration (see `_output_lock`).
LOCK_NAME = ".segpack-tokenize.lock"

_LOG = logging.getLogger(__name__)


def _check_arguments(inputs: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str], *,
                     workers: int, shard_tokens: int, runner: str, chat_template: str) -> None:
  """Refuses empty paths (they mean the current directory), bad counts and choices; warns about an
  input given twice (its documents would be stored twice)."""
  if not str(output).strip():
    raise InputFormatError(
        f"output (--output) must name a directory, got {str(output)!r} (an empty path would "
        f"write into the current directory)")
  if any(not str(p).strip() for p in inputs):
    raise InputFormatError(
        f"inputs (--input) must not hold an empty path (it would read the current directory), "
        f"got {[str(p) for p in inputs]}")
  seen = set()
  for p in inputs:
    key = os.path.abspath(os.fspath(p))
    if key in seen:
      _LOG.warning("inputs (--input) name %s twice: its documents are tokenized twice", p)
    seen.add(key)
  if not isinstance(workers, int) or workers < 1:
    raise InputFormatError(f"workers (--workers) must be a positive int, got {workers!r}")
  if not isinstance(shard_tokens, int) or shard_tokens < 1:
    raise InputFormatError(
        f"shard_tokens (--shard-tokens) must be a positive int, got {shard_tokens!r}")
  if runner not in ("local", "beam"):
    raise InputFormatError(f"runner (--runner) must be 'local' or 'beam', got {runner!r}")
  if chat_template not in CHAT_TEMPLATES:
    raise InputFormatError(f"chat_template (--chat-template) must be one of {CHAT_TEMPLATES}, "
                           f"got {chat_template!r}")


def refuse_chat_template(chat_template: str, *, why: str,
                         options: hf_chat.ChatOptions | None = None) -> None:
  """Refuses `chat_template` other than "auto", and rendering `options` other than the defaults,
  for inputs that are not chat (`why` says why they are not)."""
  if chat_template != "auto":
    raise InputFormatError(f"chat_template={chat_template!r} (--chat-template) applies to chat "
                           f"data only, input_format='chat' (--format); {why}")
  if options is not None and options != hf_chat.ChatOptions():
    raise InputFormatError(f"chat_options={options!r} (--turns, --reasoning, --chat-date, "
                           f"--chat-template-file) apply to chat data only, input_format='chat' "
                           f"(--format); {why}")


def tokenize_files(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    spm_model: str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    doc_separator: str = "file",
    text_field: str = "text",
    skip_bad_lines: bool = False,
    workers: int | None = None,
    shard_tokens: int = encode.DEFAULT_SHARD_TOKENS,
    progress: bool = False,
    overwrite: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    input_format: str = "auto",
    train_on: str = "assistant",
    messages_field: str = "messages",
    runner: str = "local",
    beam_options: str = "",
    unit_records: int = beam_pipeline.DEFAULT_UNIT_RECORDS,
    chat_template: str = "auto",
    chat_options: hf_chat.ChatOptions | None = None,
) -> list[encode.Summary]:
  """The CLI as a function: tokenizes `inputs` into `output` (or its train/ and eval/).

  `tokenizer` (a spec, `"spm:PATH"` or `"hf:PATH/tokenizer.json"`), `spm_model` and `vocab_size`
  exclude each other; `chat_template` is `--chat-template` (one of `CHAT_TEMPLATES`: the renderer
  of chat data, part of the resume key); `chat_options` are the choices of rendering with a
  tokenizer's own chat template (`--turns`, `--reasoning`, `--chat-date`,
  `--chat-template-file`); the other arguments are the CLI's flags.

  Returns:
    One summary per dataset written (two for `builtin`: train and eval).
  """
  workers = (os.cpu_count() or 1) if workers is None else workers
  _check_arguments(inputs, output, workers=workers, shard_tokens=shard_tokens, runner=runner,
                   chat_template=chat_template)
  output = Path(output)
  with _output_lock(output, runner):
    given = _given_tokenizer(tokenizer, spm_model, vocab_size)
    builtin = [s for s in map(str, inputs) if s == "builtin" or s.startswith("builtin:")]
    if builtin:
      if len(inputs) != 1 or builtin[0] not in ("builtin", "builtin:full", "builtin:small"):
        raise InputFormatError(f"inputs (--input) holding builtin[:full|:small] must hold it "
                               f"alone, got {[str(p) for p in inputs]}")
      refuse_chat_template(chat_template, why=f"inputs={builtin} (--input) are plain text",
                           options=chat_options)
      return _tokenize_builtin(
          builtin[0].partition(":")[2] or "full", output, given=given, tokenizer=tokenizer,
          vocab_size=vocab_size, cache_dir=cache_dir, runner=runner, workers=workers,
          shard_tokens=shard_tokens, unit_records=unit_records, beam_options=beam_options,
          progress=progress, overwrite=overwrite)

    skipped: collections.Counter[str] = collections.Counter()
    files = expand_inputs(inputs, skipped=skipped)
    if not files:
      raise InputFormatError("inputs (--input): no input files given")
    structured = _structured(
        files, output, input_format=input_format, runner=runner, text_field=text_field,
        messages_field=messages_field, given=given, vocab_size=vocab_size, spec=tokenizer,
        train_on=train_on, shard_tokens=shard_tokens, overwrite=overwrite,
        skip_bad_lines=skip_bad_lines, chat_template=chat_template, options=chat_options)
    if structured is not None:
      return _said(inputs, files, skipped, None, [structured])
    refuse_chat_template(chat_template, why=f"input_format={input_format!r} (--format) reads "
                                            f"the inputs as plain text", options=chat_options)
    read = dict(doc_separator=doc_separator, text_field=text_field, skip_bad_lines=skip_bad_lines)
    ident = {"inputs": [encode.file_identity(p) for p in files], **read}
    if given is not None:
      tokenizer = given
    elif vocab_size is not None:
      tokenizer = tokenizer_cache.trained_tokenizer(
          iter_documents(files, **read), output / "spm.model", vocab_size=vocab_size, key=ident,
          protect=[output], overwrite=overwrite, progress=progress)
    else:
      raise InputFormatError(chat_write.NO_TOKENIZER)
    if runner == "beam":
      summary = beam_pipeline.tokenize_files_beam(
          files, output, tokenizer=tokenizer, read=read, ident=ident,
          metadata={"inputs": [str(p) for p in files], **tokenizer_cache.model_entry(tokenizer), **read},
          shard_tokens=shard_tokens, unit_records=unit_records, beam_options=beam_options,
          overwrite=overwrite)
      tokenizer_cache.keep_tokenizer(tokenizer, output)
      return _said(inputs, files, skipped, None, [summary])
    return _tokenize_local(inputs, files, skipped, output, tokenizer=tokenizer, read=read,
                           ident=ident, workers=workers, shard_tokens=shard_tokens,
                           progress=progress, overwrite=overwrite)


def _tokenize_local(inputs: Sequence[str | os.PathLike[str]], files: Sequence[Path],
                    skipped: collections.Counter[str], output: Path, *,
                    tokenizer: tokenizer_spec.Tokenizer, read: dict[str, Any],
                    ident: dict[str, Any], workers: int, shard_tokens: int, progress: bool,
                    overwrite: bool) -> list[encode.Summary]:
  """Plain text inputs through `encode.write_dataset` (worker processes on this machine)."""
  start = time.perf_counter()
  counters = ReadCounters()
  documents: collections.Counter[str] = collections.Counter()
  stages: dict[str, float] = {}

  def at_end() -> None:  # Inputs without a document give no dataset (and no manifest).
    if not sum(documents.values()):
      raise _no_documents(inputs, describe_inputs(files, skipped, documents), counters.bad_lines)

  texts = input_ranges.RangedInputs(
      files, read=read, counters=counters, documents=documents, at_end=at_end,
      here=lambda: iter_documents(files, counters=counters, documents=documents, **read))
  manifest, resumed, nbytes = encode.write_dataset(
      texts, output,
      tokenizer=tokenizer, resume_key=encode.resume_key(dict(
          ident, tokenizer=tokenizer.fingerprint, shard_tokens=shard_tokens)),
      workers=workers, shard_tokens=shard_tokens, progress=progress, overwrite=overwrite,
      metadata={"inputs": [str(p) for p in files], **tokenizer_cache.model_entry(tokenizer), **read},
      stage_seconds=stages)
  tokenizer_cache.keep_tokenizer(tokenizer, output)
  return _said(inputs, files, skipped, documents or None, [encode.summarize(
      output, manifest, resumed=resumed, bad_lines=counters.bad_lines,
      seconds=time.perf_counter() - start, text_bytes=nbytes, stages=stages or None)])


def _no_documents(inputs: Sequence[str | os.PathLike[str]], report: str,
                  bad_lines: int = 0) -> InputFormatError:
  """The one-line refusal of inputs that give no document, naming them and what was read."""
  bad = f"; {bad_lines:,} records without usable text skipped" if bad_lines else ""
  return InputFormatError(
      f"inputs={[str(p) for p in inputs]} (--input): no documents to tokenize ({report}{bad}); "
      f"a dataset needs at least one document with text")


def _structured(files: Sequence[Path], output: Path, *, input_format: str, runner: str,
                text_field: str | None, messages_field: str, train_on: str,
                **kwargs) -> encode.Summary | None:
  """Preference pairs (`segpack.text.chat.preference`) or chat (`chat.write`), tokenized
  locally; None for plain text."""
  paired = input_format in ("preference", "prompts")
  chat = not paired and is_chat(
      files, input_format, text_field=text_field, messages_field=messages_field)
  if not paired and not chat:
    return None
  if runner == "beam":
    what = "chat" if chat else ("preference pairs" if input_format == "preference" else "prompts")
    raise InputFormatError(f"runner='beam' (--runner) tokenizes plain text; run {what} locally")
  if chat:
    return chat_write.tokenize_chat(files, output, train_on=train_on,
                                    messages_field=messages_field, **kwargs)
  if input_format == "prompts":
    return prompts_write.tokenize_prompts(files, output, **kwargs)
  return preference_write.tokenize_preference(files, output, **kwargs)


def _said(inputs: Sequence[str | os.PathLike[str]], files: Sequence[Path],
          skipped: collections.Counter[str], documents: collections.Counter[str] | None,
          summaries: list[encode.Summary]) -> list[encode.Summary]:
  """Says on stderr (a warning when files were not read) what the inputs gave, by file type;
  refuses a dataset without documents (a chat or Beam run writes one before it can tell)."""
  report = describe_inputs(files, skipped, documents)
  if any(s.documents == 0 for s in summaries):
    raise _no_documents(inputs, report, sum(s.bad_lines for s in summaries))
  _LOG.log(logging.WARNING if skipped else logging.INFO, "inputs: %s", report)
  return summaries


@contextlib.contextmanager
def _output_lock(output: Path, runner: str) -> Iterator[None]:
  """Holds `output/LOCK_NAME` for a local run; another run on the same `--output` is refused at
  once, naming the holder. The lock is the operating system's (`fcntl.flock`): it goes when its
  process ends, killed or not. (Beam writes from many machines; its runs are not locked.)"""
  if runner != "local":
    yield
    return
  fresh = not output.exists()
  try:
    with file_lock(output / LOCK_NAME, wait=False):
      yield
  except LockHeldError as e:
    raise InputFormatError(
        f"output={str(output)!r} (--output) is in use by another segpack tokenize run "
        f"({e.owner}; lock file {e.path}); wait for it to finish or stop it") from None
  except BaseException:
    # A run refused before it wrote anything leaves no directory behind (only its lock file).
    if fresh and output.is_dir() and {p.name for p in output.iterdir()} <= {LOCK_NAME}:
      shutil.rmtree(output, ignore_errors=True)
    raise


def _tokenize_builtin(size: str, output: Path, *, given, tokenizer: str | None,
                      vocab_size: int | None, cache_dir, runner: str, workers: int,
                      shard_tokens: int, unit_records: int, beam_options: str, progress: bool,
                      overwrite: bool) -> list[encode.Summary]:
  """`--input builtin[:size]`: the built-in corpus's train and eval splits under `output`."""
  if given is not None and not isinstance(given, spm_lib.SpmTokenizer):
    raise InputFormatError(f"tokenizer={tokenizer!r} (--tokenizer): inputs=['builtin'] (--input) "
                           f"take a SentencePiece model only: spm:PATH or spm_model (--spm-model)")
  if given is not None:
    model = given
  elif vocab_size is not None:
    train_texts = (t for _, t in corpus.builtin_documents(split="train", size=size))
    model = tokenizer_cache.trained_tokenizer(
        train_texts, output / "spm.model", vocab_size=vocab_size,
        key={"builtin": corpus.corpus_key(size)}, protect=[output / "train", output / "eval"],
        overwrite=overwrite)
  else:
    model = corpus.builtin_tokenizer(size=size, cache_dir=cache_dir)
  model = tokenizer_cache.copy_model(model, output, overwrite=overwrite)
  if runner == "beam":
    return beam_pipeline.builtin_splits_beam(
        output, size, model, shard_tokens=shard_tokens, unit_records=unit_records,
        beam_options=beam_options, progress=progress, overwrite=overwrite)
  return corpus.builtin_splits(output, size, model, workers=workers,
                               shard_tokens=shard_tokens, progress=progress, overwrite=overwrite)


def _given_tokenizer(spec: str | None, spm_model: str | os.PathLike[str] | None,
                     vocab_size: int | None) -> tokenizer_spec.Tokenizer | None:
  """The tokenizer of `--tokenizer` or `--spm-model` (None: neither); at most one of the three."""
  given = [(arg, value) for arg, value in (("tokenizer", spec), ("spm_model", spm_model),
                                           ("vocab_size", vocab_size)) if value is not None]
  if len(given) > 1:
    raise InputFormatError(
        "pass one of tokenizer (--tokenizer), spm_model (--spm-model), vocab_size "
        "(--vocab-size), got " + ", ".join(f"{arg}={value!r}" for arg, value in given))
  if spm_model is not None:
    return spm_lib.SpmTokenizer(spm_model)
  if spec is None:
    return None
  try:
    return tokenizer_spec.from_spec(spec)
  except (ValueError, TypeError, OSError, ImportError) as e:
    raise InputFormatError(f"tokenizer={spec!r} (--tokenizer): {e}") from e

"""`--format chat` of `segpack tokenize`: conversations to a shard dataset with a loss mask.

The renderer is as `chat_template` (`--chat-template`) says: `auto` the tokenizer's own chat
template when it has one (`segpack.text.chat.hf_chat.HfChatTemplate`, with `ChatOptions`: `--turns`,
`--reasoning`, `--chat-date`, `--chat-template-file`), else segpack's `chat.ChatTemplate`; `own`
the tokenizer's own (refused without one); `segpack` segpack's even when the tokenizer has its own.
Without a tokenizer, a SentencePiece model is trained first on the contents (`--vocab-size`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from segpack import errors
from segpack import shards as shards_lib
from segpack.files import atomic_write_json
from segpack.text import chat
from segpack.text import encode
from segpack.text.chat import files as chat_files
from segpack.text.chat import hf_chat
from segpack.text.inputs import InputFormatError
from segpack.text.tokenizers import cache as tokenizer_cache
from segpack.text.tokenizers import hf as hf_lib
from segpack.text.tokenizers import spec as tokenizer_spec
from segpack.text.tokenizers import spm as spm_lib

__all__ = ["NO_TOKENIZER", "tokenize_chat"]

_LOG = logging.getLogger(__name__)

NO_TOKENIZER = ("pass tokenizer='hf:FILE'|'spm:FILE' (--tokenizer), spm_model=FILE (--spm-model) "
                "or vocab_size=N (--vocab-size, to train a model first)")


def chat_tokenizer(conversations, output: Path, *, given, vocab_size: int | None,
                    ident: dict[str, Any], overwrite: bool) -> tokenizer_spec.Tokenizer:
  """The tokenizer of `--format chat`: the one given, or a SentencePiece model trained on the
  contents with segpack's chat markers as symbols (kept and reused under the same key)."""
  if given is not None:
    return given
  if vocab_size is None:
    raise InputFormatError(NO_TOKENIZER)
  texts = (m.get("content", "") for _, ms in conversations() if isinstance(ms, list)
           for m in ms if isinstance(m, dict) and isinstance(m.get("content"), str))
  model_file = output / "spm.model"
  key_hash = encode.resume_key(dict(ident, vocab_size=vocab_size))
  record = model_file.with_suffix(".json")
  try:
    ok = json.loads(record.read_text("utf-8")).get("key") == key_hash
  except (OSError, ValueError):
    ok = False
  if ok and model_file.exists():
    return spm_lib.SpmTokenizer(model_file)
  tokenizer_cache.refuse_to_replace_model(model_file, [output], overwrite=overwrite)
  tokenizer = spm_lib.train_spm(texts, model_file, vocab_size=vocab_size,
                                user_defined_symbols=list(chat.DEFAULT_TEMPLATE.markers))
  atomic_write_json(record, {"key": key_hash, "fingerprint": tokenizer.fingerprint})
  return tokenizer


def _no_own_template(given: tokenizer_spec.Tokenizer | None) -> InputFormatError:
  """The refusal of `--chat-template own` for a tokenizer without a chat template of its own."""
  if isinstance(given, hf_lib.HfTokenizer):
    what = (f"the tokenizer directory {str(given.model_file.parent)!r} holds no chat template "
            f"(chat_template.jinja, chat_template.json or chat_template in {hf_lib.CONFIG_NAME})")
  else:
    what = (f"the SentencePiece model {str(given.model_file)!r}" if given is not None else
            "a SentencePiece model trained with vocab_size (--vocab-size)") + (
                " has no chat template (only tokenizer='hf:DIR' (--tokenizer) holds one)")
  return InputFormatError(f"chat_template='own' (--chat-template): {what}; pass "
                          f"chat_template='segpack' (or 'auto') to render with segpack's")


def _refuse_options(options: hf_chat.ChatOptions) -> None:
  """Refuses rendering choices that only a tokenizer's own template reads."""
  given = {f"{name} (--{flag})": value for name, flag, value in (
      ("turns", "turns", options.turns), ("reasoning", "reasoning", options.reasoning),
      ("date", "chat-date", options.date), ("template_file", "chat-template-file",
                                            options.template_file))
      if value != getattr(hf_chat.ChatOptions, name)}
  if given:
    raise InputFormatError(f"{', '.join(f'{k}={v!r}' for k, v in given.items())}: applies to a "
                           f"tokenizer's own chat template (tokenizer='hf:DIR' (--tokenizer)), not "
                           f"to segpack's chat template")


def chat_encoder(tokenizer: tokenizer_spec.Tokenizer, *, train_on: str, spec: str | None,
                  chat_template: str = "auto", options: hf_chat.ChatOptions | None = None,
                  ) -> chat.ChatEncoder | hf_chat.HfChatTemplate:
  """The tokenizer's own chat template (a Hugging Face directory holding one, or
  `options.template_file`) unless `chat_template="segpack"`, else segpack's `ChatTemplate`;
  `"own"` refuses a tokenizer without a template of its own."""
  options = options or hf_chat.ChatOptions()
  directory = tokenizer.model_file.parent if isinstance(tokenizer, hf_lib.HfTokenizer) else None
  has_own = directory is not None and (hf_chat.template_file(directory) is not None
                                       or options.template_file is not None)
  if chat_template == "own" and not has_own:
    raise _no_own_template(tokenizer)
  if not has_own or chat_template == "segpack":
    _refuse_options(options)
    encoder = chat.ChatEncoder(tokenizer, train_on=train_on)
    if has_own:
      _LOG.info("chat_template='segpack' (--chat-template): rendering conversations with "
                "segpack's chat template, not the one of %s", directory)
    if not encoder.markers_are_symbols:
      _LOG.warning("%s has no chat markers as special symbols; they are encoded as text",
                   tokenizer.model_file)
    return encoder
  try:
    encoder = hf_chat.HfChatTemplate(directory, train_on=train_on, options=options)
  except (ImportError, OSError, ValueError) as e:
    raise InputFormatError(f"tokenizer={spec!r} (--tokenizer): {errors.one_line(e)}") from e
  _LOG.info("rendering conversations with the chat template of %s (%s)", directory,
            encoder.template_file)
  return encoder


def _chat_summary(output: Path, manifest: dict[str, Any], *, resumed: int, seconds: float,
                  text_bytes: int) -> encode.Summary:
  """The summary of a chat dataset: skipped conversations and trained tokens by role too."""
  described = shards_lib.DatasetRecord.from_manifest(
      manifest, where=output / shards_lib.MANIFEST_NAME).chat or shards_lib.ChatRecord()
  by_role = described.trained_tokens_by_role
  return dataclasses.replace(
      encode.summarize(output, manifest, resumed=resumed, seconds=seconds, text_bytes=text_bytes,
                       bad_lines=described.skipped_conversations or 0),
      trained_by_role=None if by_role is None else dict(by_role), chat_turns=_turns_line(described))


def _turns_line(described: shards_lib.ChatRecord) -> str | None:
  """The summary's line on expansion per turn and empty reasoning blocks (None: not recorded)."""
  if described.samples is None or described.conversations is None:
    return None
  line = (f"{described.conversations:,} conversations -> {described.samples:,} samples "
          f"({described.expanded_conversations or 0:,} expanded per turn")
  overhead = described.expansion_overhead
  if overhead is not None:
    line += f"; stored / whole-conversation tokens {overhead:.3f}"
  line += ")"
  if described.empty_think_turns:
    line += (f"; {described.empty_think_turns:,} trained turns hold an empty reasoning block "
             f"the template wrote where the data has none")
  return line


def tokenize_chat(files: Sequence[Path], output: Path, *, given, vocab_size, train_on: str,
                  messages_field: str, shard_tokens: int, overwrite: bool,
                  skip_bad_lines: bool = False, spec: str | None = None,
                  chat_template: str = "auto", options: hf_chat.ChatOptions | None = None,
                  ) -> encode.Summary:
  """`--format chat`: conversations to tokens + loss mask (single process; `segpack.text.chat`,
  or `segpack.text.chat.hf_chat` for a tokenizer with its own chat template, as `chat_template`
  picks; `options` are the choices of the latter)."""
  def conversations(skipped: chat.Skipped | None = None):
    for path in files:
      try:
        yield from chat_files.read_conversations(path, messages_field=messages_field,
                                                 skipped=skipped)
      except (OSError, EOFError, zlib.error) as e:  # Corrupt or truncated gzip, I/O errors.
        raise InputFormatError(f"{path}: unreadable ({type(e).__name__}: {e})") from e

  ident = {"inputs": [encode.file_identity(p) for p in files], "format": "chat",
           "messages_field": messages_field, "train_on": train_on,
           "template": dataclasses.asdict(chat.DEFAULT_TEMPLATE)}
  if skip_bad_lines:
    ident["skip_bad_lines"] = True
  if chat_template == "own" and not isinstance(given, hf_lib.HfTokenizer):
    raise _no_own_template(given)
  tokenizer = chat_tokenizer(
      lambda: conversations(chat.Skipped() if skip_bad_lines else None), output, given=given,
      vocab_size=vocab_size, ident=ident, overwrite=overwrite)
  encoder = chat_encoder(tokenizer, train_on=train_on, spec=spec, chat_template=chat_template,
                          options=options)
  own = isinstance(encoder, hf_chat.HfChatTemplate)
  if chat_template != "auto":  # the choice is part of the key ("auto" keeps earlier keys)
    ident["chat_template"] = chat_template
  if own:
    ident["template"] = encoder.describe()
  key = encode.resume_key(dict(ident, tokenizer=tokenizer.fingerprint, shard_tokens=shard_tokens))
  finished = encode.finished_dataset(output, key, overwrite=overwrite)
  if finished is None:
    if overwrite:  # `write_chat_dataset` would return a finished dataset with the same key as is.
      (output / shards_lib.MANIFEST_NAME).unlink(missing_ok=True)
    start = time.perf_counter()
    skipped = chat.Skipped() if skip_bad_lines else None
    finished = chat_files.write_chat_dataset(
        conversations(skipped), output, encoder=encoder, shard_tokens=shard_tokens,
        resume_key=key, skipped=skipped,
        metadata={"inputs": [str(p) for p in files], **tokenizer_cache.model_entry(tokenizer)})
    if skipped is not None and skipped.count:
      _LOG.warning("skip_bad_lines (--skip-bad-lines): %d conversation(s) skipped; the first: "
                   "%s", skipped.count, skipped.first)
    seconds, text_bytes, resumed = (time.perf_counter() - start,
                                    sum(p.stat().st_size for p in files), 0)
  else:
    seconds, text_bytes, resumed = 0.0, 0, len(finished["shards"])
  tokenizer_cache.keep_tokenizer(tokenizer, output)
  if own:
    encoder.keep_files(output)
  return _chat_summary(output, finished, resumed=resumed, seconds=seconds, text_bytes=text_bytes)


@dataclasses.dataclass(frozen=True)
class Written:
  """A records dataset as `tokenize_records` left it: its manifest, the shards an earlier run
  had written, the seconds this run took, and the tokenizer."""

  manifest: dict[str, Any]
  resumed: int
  seconds: float
  tokenizer: Any


def tokenize_records(files: Sequence[Path], output: Path, *, kind: str, read, texts, write,
                     given, vocab_size, shard_tokens: int, overwrite: bool, skip_bad_lines: bool,
                     chat_template: str, options: hf_chat.ChatOptions | None,
                     complete=lambda output: True) -> Written:
  """The run of `--format preference` and `--format prompts`: the tokenizer (given, or trained
  on the records' texts and kept under the inputs' key), the resume key, a finished dataset kept
  as it is (unless `complete(output)` says part of it is missing), else `write(records,
  tokenizer=, key=, skipped=, metadata=)` over `read(skipped)`, and the tokenizer kept beside.

  Args:
    kind: the format's name (part of the resume key).
    read: `skipped -> records` (`skipped` a `chat.Skipped` or None).
    texts: `record -> (where, messages)` whose contents train a SentencePiece tokenizer.
    write: writes the records; returns the finished manifest.
  """
  ident = {"inputs": [encode.file_identity(p) for p in files], "format": kind,
           "chat_template": chat_template, "options": repr(options)}
  if skip_bad_lines:
    ident["skip_bad_lines"] = True
  tokenizer = chat_tokenizer(lambda: (texts(r) for r in read(chat.Skipped())), output,
                             given=given, vocab_size=vocab_size, ident=ident, overwrite=overwrite)
  key = encode.resume_key(dict(ident, tokenizer=tokenizer.fingerprint, shard_tokens=shard_tokens))
  finished = encode.finished_dataset(output, key, overwrite=overwrite)
  if finished is not None and not complete(output):
    finished = None  # the shards were written, what follows them not yet: write again
  start, resumed = time.perf_counter(), 0
  if finished is None:
    if overwrite:
      (output / shards_lib.MANIFEST_NAME).unlink(missing_ok=True)
    skipped = chat.Skipped() if skip_bad_lines else None
    finished = write(read(skipped), tokenizer=tokenizer, key=key, skipped=skipped,
                     metadata={"inputs": [str(p) for p in files],
                               **tokenizer_cache.model_entry(tokenizer),
                               "tokenizer": tokenizer.describe()})
  else:
    resumed = len(finished["shards"])
  tokenizer_cache.keep_tokenizer(tokenizer, output)
  return Written(manifest=finished, resumed=resumed, seconds=time.perf_counter() - start,
                 tokenizer=tokenizer)

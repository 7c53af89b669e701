"""`segpack tokenize --runner beam` when an input, the output or the tokenizer file is a URL.

The driver lists the `--input` URLs (`remote_inputs.expand_remote_inputs`), identifies each file
by its URL, size and modification time (the resume key, as the local path's), copies the
tokenizer file to this machine to check it and take its fingerprint (every worker copies it too,
from the URL), and runs `beam_pipeline.write_dataset_beam` with the output URL: shards and
done-records are uploaded under their final names, each unit is read back and checked, and the
manifest is uploaded last (docs/ingest.md). The summary's length statistics come from the
offsets files alone.

The local runner reads and writes local paths only: a URL with it is refused in one line that
points to `--runner beam`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segpack import remote_files
from segpack.shards.format import OFFSET_DTYPE
from segpack.text import encode
from segpack.text.beam import driver as beam_driver
from segpack.text.beam import pipeline as beam_pipeline
from segpack.text.beam import remote_inputs
from segpack.text.inputs import InputFormatError
from segpack.text.tokenizers import spec as tokenizer_spec

__all__ = ["tokenize_remote"]


def _check_flags(inputs: Sequence[str], remote: list[str], *, runner: str,
                 vocab_size: int | None, input_format: str) -> None:
  """One-line refusals of what the URL path does not do."""
  if runner != "beam":
    raise InputFormatError(f"{remote[0]!r} is a URL: runner={runner!r} (--runner) reads and "
                           f"writes local paths only; pass runner='beam' to read and write URLs "
                           f"(docs/ingest.md)")
  if any(str(p) == "builtin" or str(p).startswith(("builtin:", "hf-disk:")) for p in inputs):
    raise InputFormatError(f"inputs={[str(p) for p in inputs]} (--input): builtin and hf-disk: "
                           f"inputs are local; with URLs give files or prefixes of files")
  if vocab_size is not None:
    raise InputFormatError(f"vocab_size={vocab_size} (--vocab-size) trains a model on this "
                           f"machine from local inputs; with URLs pass spm_model (--spm-model) "
                           f"or tokenizer (--tokenizer), a URL too")
  if input_format == "chat":
    raise InputFormatError("runner='beam' (--runner) tokenizes plain text; chat inputs, "
                           "input_format='chat' (--format), run with runner='local'")


def _tokenizer(spm_model: str | None, tokenizer: str | None, cache_dir: str | None
               ) -> tuple[tokenizer_spec.Tokenizer, str, str]:
  """(tokenizer from a local copy, the spec workers rebuild it from, its file's path or URL)."""
  if spm_model is not None and tokenizer is not None:
    raise InputFormatError(f"pass one of tokenizer (--tokenizer), spm_model (--spm-model), got "
                           f"tokenizer={tokenizer!r}, spm_model={spm_model!r}")
  if spm_model is None and tokenizer is None:
    raise InputFormatError("pass tokenizer='hf:FILE'|'spm:FILE' (--tokenizer) or spm_model=FILE "
                           "(--spm-model)")
  spec = f"spm:{spm_model}" if spm_model is not None else str(tokenizer)
  kind, path = tokenizer_spec.split_spec(spec)
  if not remote_files.is_url(path):
    path = str(Path(path).resolve())
    spec = f"{kind}:{path}"
  try:
    tok = tokenizer_spec.from_spec(remote_inputs.local_tokenizer_spec(spec, cache_dir=cache_dir))
  except (ValueError, TypeError, OSError, ImportError) as e:
    raise InputFormatError(f"tokenizer={spec!r} (--tokenizer): {e}") from e
  return tok, spec, path


def _summary(output: str, manifest: dict[str, Any], *, kept: int, bad_lines: int, seconds: float,
             text_bytes: int) -> encode.Summary:
  """`encode.summarize` of a dataset at a URL, its lengths read from the offsets files."""
  parts = [np.diff(np.frombuffer(remote_files.read_bytes(remote_files.join(output, s["offsets"])),
                                 dtype=OFFSET_DTYPE)) for s in manifest["shards"]]
  lengths = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
  return encode.summarize(output, manifest, resumed=kept, bad_lines=bad_lines, seconds=seconds,
                          text_bytes=text_bytes, lengths=lengths)


def tokenize_remote(
    inputs: Sequence[str], output: str, *, runner: str, spm_model: str | None = None,
    tokenizer: str | None = None, vocab_size: int | None = None, doc_separator: str = "file",
    text_field: str = "text", skip_bad_lines: bool = False,
    shard_tokens: int = encode.DEFAULT_SHARD_TOKENS,
    unit_records: int = beam_pipeline.DEFAULT_UNIT_RECORDS, beam_options: str = "",
    overwrite: bool = False, input_format: str = "auto", cache_dir: str | None = None,
) -> encode.Summary:
  """`segpack tokenize` with URLs among `inputs`, `output`, `spm_model` and `tokenizer`.

  Args:
    inputs: files or prefixes (URLs or local paths); a prefix contributes its `.txt`, `.jsonl`
      (plain, `.gz`, `.zst`) and `.parquet` files at any depth, sorted.
    output: the dataset directory, a URL (`gs://B/P`, `s3://B/P`, `hdfs://...`) or a local path.
    runner: must be `"beam"` (else the one-line refusal).
    spm_model, tokenizer: the tokenizer file (one of them), either may be a URL.
    beam_options: Beam's flags, which also configure its filesystems (`--s3_endpoint_url=URL`,
      `--s3_region_name=R`, `--project=P`, `--hdfs_host=H`, ...).
    cache_dir: where the driver and the workers copy a tokenizer file named by URL.
    The other arguments are `dataset.tokenize_files`'.

  Returns:
    The run's summary (the CLI prints its table).
  """
  remote = remote_inputs.remote_flags(paths=[*inputs, output, spm_model, tokenizer])
  _check_flags(inputs, remote or [str(output)], runner=runner, vocab_size=vocab_size,
               input_format=input_format)
  if not isinstance(shard_tokens, int) or shard_tokens < 1:
    raise InputFormatError(
        f"shard_tokens (--shard-tokens) must be a positive int, got {shard_tokens!r}")
  start = time.perf_counter()
  beam_driver.import_beam()
  beam_driver.pipeline_options(beam_options)  # Configures Beam's filesystems for the listing.
  files_in = remote_inputs.expand_remote_inputs([str(p) for p in inputs])
  tok, worker_spec, model_path = _tokenizer(spm_model, tokenizer, cache_dir)
  read = dict(doc_separator=doc_separator, text_field=text_field, skip_bad_lines=skip_bad_lines)
  infos = [remote_files.file_info(p) for p in files_in]
  ident = {"inputs": [[i["path"], i["size"], i["mtime"]] for i in infos], **read}
  key = encode.resume_key(dict(ident, tokenizer=tok.fingerprint, shard_tokens=shard_tokens,
                               runner="beam", unit_records=unit_records))
  model_key = "tokenizer_file" if worker_spec.startswith("hf:") else "spm_model"
  out = str(output) if remote_files.is_url(output) else str(Path(output).resolve())
  manifest, kept, nbytes, bad_lines = beam_pipeline.write_dataset_beam(
      out, tokenizer=tok, worker_spec=worker_spec, resume_key=key,
      files_in=[i["path"] for i in infos], read=read, shard_tokens=shard_tokens,
      unit_records=unit_records, beam_options=beam_options, overwrite=overwrite,
      metadata={"inputs": [i["path"] for i in infos], model_key: model_path, **read})
  seconds = time.perf_counter() - start
  if not remote_files.is_url(out):
    return encode.summarize(Path(out), manifest, resumed=kept, bad_lines=bad_lines,
                            seconds=seconds, text_bytes=nbytes)
  return _summary(out, manifest, kept=kept, bad_lines=bad_lines, seconds=seconds,
                  text_bytes=nbytes)

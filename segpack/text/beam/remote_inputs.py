"""Inputs and tokenizer files named by URL (`gs://`, `s3://`, `hdfs://`) for `--runner beam`.

`expand_remote_inputs` lists `--input` URLs the way `inputs.expand_inputs` lists local paths (a
prefix contributes its supported files, sorted by URL); `iter_remote_records` reads one input
file as `inputs.iter_file_records` does, from a temporary local copy (compressed and Parquet
files need seeking or a whole stream), with errors naming the URL; `local_tokenizer_spec` copies
a tokenizer file (and, for `hf:`, the `tokenizer_config.json` beside it) into the cache and names
the copy. All of it goes through `segpack.remote_files` (Beam's filesystems).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from segpack import files
from segpack import remote_files
from segpack.text.inputs import SUFFIXES, InputFormatError, ReadCounters, iter_file_records
from segpack.text.tokenizers import hf as hf_lib
from segpack.text.tokenizers import spec as tokenizer_spec
from segpack.text.tokenizers import spm as spm_lib

__all__ = ["expand_remote_inputs", "iter_remote_records", "local_tokenizer_spec", "remote_flags"]


def remote_flags(*, paths: Sequence[Any]) -> list[str]:
  """The values among `paths` that name a URL (`--input`, `--output`, `--spm-model`, or a
  tokenizer spec such as `hf:gs://...`); None values are left out."""
  out = []
  for value in (str(p) for p in paths if p is not None):
    kind, sep, rest = value.partition(":")
    if remote_files.is_url(rest if sep and kind in tokenizer_spec.KINDS else value):
      out.append(value)
  return out


def expand_remote_inputs(paths: Sequence[str]) -> list[str]:
  """Input files in order: a URL ending in a supported suffix is a file, any other URL a prefix
  whose supported files (at any depth) come sorted; local paths as `inputs.expand_inputs`."""
  out: list[str] = []
  for raw in map(str, paths):
    if raw.endswith(SUFFIXES):
      if not remote_files.exists(raw):
        raise InputFormatError(f"input {raw!r} (inputs, --input): no such file")
      out.append(raw)
      continue
    found = [p for p in remote_files.list_files(raw.rstrip("/"), recursive=True)
             if p.endswith(SUFFIXES)]
    if not found:
      raise InputFormatError(f"input {raw!r} (inputs, --input): no {', '.join(SUFFIXES)} files "
                             f"under it (a file URL must end in one of these suffixes)")
    out.extend(found)
  return out


def iter_remote_records(path: str, *, counters: ReadCounters,
                        **read: Any) -> Iterator[tuple[int, str]]:
  """`inputs.iter_file_records` of a local path or a URL (read from a temporary local copy;
  an error names the URL, not the copy)."""
  with remote_files.local_copy(path) as local:
    try:
      yield from iter_file_records(local, counters=counters, **read)
    except InputFormatError as e:
      if str(local) == path:
        raise
      raise InputFormatError(str(e).replace(str(local), path)) from e


def local_tokenizer_spec(spec: str, *, cache_dir: str | os.PathLike[str] | None = None) -> str:
  """`spec` itself when its file is local; for a URL, the spec of a copy of the file under
  `$SEGPACK_CACHE/remote-tokenizers/` (rewritten on each call, atomically)."""
  kind, path = tokenizer_spec.split_spec(spec)
  if not remote_files.is_url(path):
    return spec
  folder = (spm_lib.cache_root(cache_dir) / "remote-tokenizers"
            / hashlib.sha256(path.encode("utf-8")).hexdigest()[:20])
  folder.mkdir(parents=True, exist_ok=True)
  name = path.rstrip("/").rsplit("/", 1)[-1]
  try:
    files.atomic_write_bytes(folder / name, remote_files.read_bytes(path))
  except OSError as e:
    raise InputFormatError(f"tokenizer file {path!r}: cannot read it ({e})") from e
  if kind == "hf":
    config = path.rstrip("/").rsplit("/", 1)[0] + "/" + hf_lib.CONFIG_NAME
    if remote_files.exists(config):
      files.atomic_write_bytes(folder / hf_lib.CONFIG_NAME, remote_files.read_bytes(config))
    else:
      (folder / hf_lib.CONFIG_NAME).unlink(missing_ok=True)
  return f"{kind}:{folder / name}"

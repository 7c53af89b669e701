"""Arrow inputs: Parquet files and Hugging Face `datasets` directories written by `save_to_disk`.

Both are read one column (`--text-field`) at a time in record batches of at most `BATCH_ROWS` rows,
never a whole file into memory: Parquet with `pyarrow.parquet.ParquetFile.iter_batches`, the
Arrow IPC *stream* files of a `save_to_disk` directory with `pyarrow.ipc.open_stream` over a memory
map (the `datasets` library itself is not needed, and the hub is never contacted).

The readers yield `(row, value)`: the 1-based row number within the file and the cell as a Python
value (`str`; `bytes` for a binary column or a string cell that is not valid UTF-8; `None` for a
null; anything else for a column of another type). `segpack.text.inputs` decides which values are
documents. Problems with the file itself (not Parquet, truncated, no such column, an unfinished
Arrow stream) raise `InputFormatError` naming the file.

pyarrow is the optional extra `segpack[parquet]`; it is imported on first use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from segpack.text.input_errors import InputFormatError

__all__ = ["BATCH_ROWS", "HF_DISK_PREFIX", "arrow_stream_values", "hf_disk_files",
           "parquet_values"]

BATCH_ROWS = 1024
HF_DISK_PREFIX = "hf-disk:"
# An Arrow IPC stream ends with this end-of-stream marker (continuation token, zero length);
# a stream cut at a message boundary would otherwise read as a shorter, complete one.
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _pyarrow(path: Path, what: str):
  """The pyarrow module, or an InputFormatError naming the extra to install."""
  try:
    import pyarrow  # optional: the `segpack[parquet]` extra (Parquet and hf-disk inputs)
    import pyarrow.ipc  # optional: the `segpack[parquet]` extra
    import pyarrow.parquet  # optional: the `segpack[parquet]` extra
  except ImportError as e:
    raise InputFormatError(f"{path}: reading {what} needs pyarrow: pip install "
                           f"'segpack[parquet]' ({e})") from e
  return pyarrow


def hf_disk_files(spec: str) -> list[Path]:
  """The Arrow files of `hf-disk:PATH` (a `datasets` `save_to_disk` directory), in order.

  A `DatasetDict` directory (one subdirectory per split) is refused with its splits listed: pass
  `hf-disk:PATH/SPLIT`.
  """
  root = Path(spec[len(HF_DISK_PREFIX):] if spec.startswith(HF_DISK_PREFIX) else spec)
  arg = f"input {HF_DISK_PREFIX}{root} (inputs, --input)"
  if not root.is_dir():
    raise InputFormatError(f"{arg}: no such directory")
  if (root / "dataset_dict.json").is_file():
    try:
      splits = json.loads((root / "dataset_dict.json").read_text("utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise InputFormatError(f"{arg}: unreadable dataset_dict.json ({e})") from e
    example = splits[0] if isinstance(splits, list) and splits else "SPLIT"
    raise InputFormatError(f"{arg}: a DatasetDict with splits {splits}; pass "
                           f"{HF_DISK_PREFIX}{root / str(example)} (one split)")
  state_file = root / "state.json"
  if not state_file.is_file():
    raise InputFormatError(f"{arg}: not a datasets save_to_disk directory (no state.json or "
                           f"dataset_dict.json)")
  try:
    names = [entry["filename"]
             for entry in json.loads(state_file.read_text("utf-8"))["_data_files"]]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise InputFormatError(f"{state_file}: no list of _data_files with a filename each ({e})"
                           ) from e
  files = []
  for name in names:
    path = root / str(name)
    if not isinstance(name, str) or path.parent != root or not path.is_file():
      raise InputFormatError(f"{state_file}: data file {name!r} is missing")
    files.append(path)
  if not files:
    raise InputFormatError(f"{state_file}: lists no data files")
  return files


def _column_values(pa, column, first_row: int, batch_rows: int) -> Iterator[tuple[int, Any]]:
  """(row, value) of one column of a record batch, `batch_rows` rows converted at a time."""
  for start in range(0, len(column), batch_rows):
    part = column.slice(start, batch_rows)
    try:
      values = part.to_pylist()
    except UnicodeDecodeError:  # A string cell that is not UTF-8: hand over its bytes.
      binary = pa.large_binary() if pa.types.is_large_string(part.type) else pa.binary()
      values = part.cast(binary).to_pylist()
    for offset, value in enumerate(values):
      yield first_row + start + offset, value


def _check_column(path: Path, names: list[str], text_field: str) -> int:
  if text_field not in names:
    raise InputFormatError(f"{path}: no column {text_field!r} (found: {sorted(names)[:20]}); "
                           f"pass text_field (--text-field)")
  return names.index(text_field)


def parquet_values(path: str | os.PathLike[str], *, text_field: str,
                   batch_rows: int = BATCH_ROWS) -> Iterator[tuple[int, Any]]:
  """(row, value) of column `text_field` of a Parquet file, read in record batches."""
  path = Path(path)
  pa = _pyarrow(path, "Parquet files")
  try:
    parquet = pa.parquet.ParquetFile(path)
    names = list(parquet.schema_arrow.names)
  except (pa.ArrowException, OSError) as e:
    raise InputFormatError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})"
                           ) from e
  _check_column(path, names, text_field)
  row = 1
  try:
    with parquet:
      for batch in parquet.iter_batches(columns=[text_field], batch_size=batch_rows):
        column = batch.column(0)
        yield from _column_values(pa, column, row, batch_rows)
        row += len(column)
  except (pa.ArrowException, OSError) as e:
    raise InputFormatError(f"{path}: unreadable after row {row - 1} ({type(e).__name__}: {e})"
                           ) from e


def arrow_stream_values(path: str | os.PathLike[str], *, text_field: str,
                        batch_rows: int = BATCH_ROWS) -> Iterator[tuple[int, Any]]:
  """(row, value) of column `text_field` of an Arrow IPC stream file (as `save_to_disk` writes),
  batch by batch over a memory map."""
  path = Path(path)
  pa = _pyarrow(path, "Arrow files")
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      size = f.tell()
      f.seek(max(0, size - len(_END_OF_STREAM)))
      tail = f.read()
  except OSError as e:
    raise InputFormatError(f"{path}: unreadable ({e})") from e
  if tail != _END_OF_STREAM:
    raise InputFormatError(f"{path}: not a complete Arrow IPC stream (no end-of-stream marker; "
                           f"truncated or still being written?)")
  row = 1
  try:
    with pa.memory_map(str(path)) as source:
      reader = pa.ipc.open_stream(source)
      index = _check_column(path, list(reader.schema.names), text_field)
      for batch in reader:
        column = batch.column(index)
        yield from _column_values(pa, column, row, batch_rows)
        row += len(column)
  except (pa.ArrowException, OSError) as e:
    raise InputFormatError(f"{path}: not a readable Arrow IPC stream after row {row - 1} "
                           f"({type(e).__name__}: {e})") from e

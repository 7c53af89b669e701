r"""The pieces of a Hugging Face model directory that `python -m train.export` writes.

Weights: every parameter becomes the tensor `train.hf.weights.tensor_map` names (transposed back
where the map says so), in the parameters' dtype, in safetensors files of at most
`max_shard_bytes` each (a single tensor larger than that gets a file of its own):
`model.safetensors` when one file holds them all, else `model-00001-of-0000N.safetensors`, ...
with `model.safetensors.index.json` (`{"metadata": {"total_size": BYTES}, "weight_map": {tensor:
file}}`), every file with the metadata `{"format": "pt"}` transformers expects.

Algorithm of `write_weights`:
  1. Plan: the tensors in `tensor_map` order, cut into shards by their byte sizes (from the
     parameters' shapes and dtype alone, nothing fetched), so the file names are known up front.
  2. For each shard: fetch its parameters one at a time (`fetch`: `jax.device_get` of that one
     array, or `process_allgather` of it when other processes hold part of it), transpose where
     needed, write the shard (`save_shard`) and drop its tensors before fetching the next shard's,
     so the host holds at most one shard's tensors, never the whole model.
  3. Write the index when there is more than one shard.
A shard the disk refuses (full, over quota, read-only: safetensors raises its own
`SafetensorError` carrying the OS error, not an `OSError`) is one `ExportError` line naming the
output, its free space and that nothing was published (`write_failed`); export then removes its
staging directory.

The other files (`write_files`): an imported model's config.json (`WORKDIR/hf_source`) with the
architecture fields rewritten from the run config (`hf_config.to_hf_config`), its
generation_config.json and tokenizer files as they were; a model trained from scratch gets a
fresh config.json of its `model.family`, generation_config.json with the tokenizer's BOS / EOS /
pad ids, and the run's tokenizer (`write_tokenizer`). A run on chat data adds its template's end
of turn to generation_config.json's EOS ids (`write_generation_config`).

Tokenizer and chat template: `train.export.tokenizer`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils
import ml_dtypes
import numpy as np

from segpack import errors
from train.hf import config as hf_config
from train.hf import init_from as hf_init
from train.hf import weights as hf_weights
from train.export import tokenizer as tokenizer_lib
from train.runs import tokenizer as run_tokenizer
from train.export.tokenizer import ExportError  # raised by both modules

_LOG = logging.getLogger(__name__)
SHARD_METADATA = {"format": "pt"}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
def parse_size(text: str) -> int:
  """`"5GB"` -> 5 * 10**9 bytes (`KB`, `MB`, `GB`, `TB` decimal, `KiB`... binary, or plain bytes).

  Raises:
    ExportError: not a positive size (naming `--max-shard-size` and the value).
  """
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
  unit = match.group(2).upper() if match else None
  if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
    raise ExportError(f"--max-shard-size={text!r} is not a size such as 5GB, 500MB, 2GiB or a "
                      f"byte count >= 1")
  return int(float(match.group(1)) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class Entry:
  """One tensor to write: the parameter it comes from (`layers/0/attn/q/kernel`), its Hugging
  Face name and transposition, its shape as written and its bytes."""
  param: str
  tensor: hf_weights.Tensor
  shape: tuple[int, ...]
  nbytes: int


def plan_shards(entries: Iterable[Entry], max_bytes: int) -> list[list[Entry]]:
  """Step 1: consecutive entries grouped so that no group exceeds `max_bytes` (an entry larger
  than that alone in its group)."""
  groups: list[list[Entry]] = []
  size = 0
  for entry in entries:
    if not groups or (size + entry.nbytes > max_bytes and groups[-1]):
      groups.append([])
      size = 0
    groups[-1].append(entry)
    size += entry.nbytes
  return groups


def shard_name(index: int, count: int) -> str:
  """The file name of shard `index` (0-based) of `count` (transformers' names)."""
  if count == 1:
    return hf_weights.SINGLE_NAME
  return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def fetch(array: jax.Array) -> np.ndarray:
  """One parameter on the host: `jax.device_get` of it, or, when other processes hold part of
  it, `process_allgather` of that one array (every process must call this, in the same order)."""
  if array.is_fully_addressable:
    return np.asarray(jax.device_get(array))
  return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def check_extras() -> None:
  """Raises ExportError naming the extra when safetensors or tokenizers is not installed."""
  for name in ("safetensors", "tokenizers"):
    try:
      importlib.import_module(name)
    except ImportError as e:
      raise ExportError(f"export writes Hugging Face files with the {name} package: pip install "
                        f"'segpack[hf]' ({e})") from e


def os_errno(error: BaseException) -> int | None:
  """The operating system's error number behind a write failure: an `OSError`'s own, or the
  `(os error N)` safetensors' `SafetensorError` message carries (its writer is Rust's, and its
  error type is not an `OSError`); None for anything else (a bug)."""
  if isinstance(error, OSError):
    return error.errno
  if type(error).__name__ == "SafetensorError":
    match = re.search(r"\(os error (\d+)\)", str(error))
    return int(match.group(1)) if match else None
  return None


def write_failed(error: BaseException, path: str) -> ExportError | None:
  """The one-line `ExportError` of a write of `path` that the disk refused (full, over quota,
  read-only, ... : any `os_errno`), naming the export's output, the space left on its file
  system and that nothing was published; None when `error` is not the operating system's."""
  number = os_errno(error)
  if number is None:
    return None
  staging = os.path.dirname(os.path.abspath(path))
  output = re.sub(r"\.tmp-\d+$", "", staging)
  try:
    free = f"{shutil.disk_usage(staging).free / 1e6:.1f} MB free"
  except OSError:
    free = "free space unknown"
  reason = os.strerror(number) if number else errors.one_line(error)
  return ExportError(f"--output {output!r}: writing {os.path.basename(path)} failed: {reason} "
                     f"({free} there); nothing was published, the partial export was removed")


def save_shard(tensors: dict[str, np.ndarray], path: str) -> None:
  """Writes one safetensors file (`safetensors.numpy.save_file`, metadata `{"format": "pt"}`).

  Raises:
    ExportError: the disk refused the write (`write_failed`); any other error passes unchanged.
  """
  from safetensors.numpy import save_file  # optional: the [hf] extra, export only
  try:
    save_file(tensors, path, metadata=SHARD_METADATA)
  except Exception as e:  # pylint: disable=broad-except  # safetensors' error is no OSError
    refused = write_failed(e, path)
    if refused is None:
      raise
    raise refused from e


def entries_of(params: dict[str, Any], tensors: dict[str, hf_weights.Tensor], *,
               dtype: str) -> list[Entry]:
  """The tensors to write for `params` (parameter path -> array or shape struct), in the order
  of `tensors` (`hf_weights.model_tensor_map`); every parameter must have its tensor."""
  unknown = sorted(set(params) - set(tensors))
  missing = sorted(set(tensors) - set(params))
  if unknown or missing:
    raise ExportError(f"the checkpoint's parameters do not match the model config: "
                      f"{'no tensor for ' + unknown[0] if unknown else 'missing ' + missing[0]}")
  itemsize = np.dtype(_NP_DTYPES[dtype]).itemsize
  out = []
  for path, tensor in tensors.items():
    shape = tuple(int(d) for d in params[path].shape)
    shape = tuple(reversed(shape)) if tensor.transpose else shape
    out.append(Entry(path, tensor, shape, int(np.prod(shape, dtype=np.int64)) * itemsize))
  return out


def write_weights(directory: str, params: dict[str, jax.Array],
                  tensors: dict[str, hf_weights.Tensor], *, dtype: str, max_shard_bytes: int,
                  write: bool = True) -> dict[str, Any]:
  """Writes the safetensors files (and index) of `params` into `directory` (the algorithm above).

  Args:
    directory: an existing, empty directory.
    params: parameter path (`train.sharding.param_name`) -> its array (sharded or not).
    tensors: `hf_weights.model_tensor_map` of the model config.
    dtype: the parameters' dtype, which the files keep ("float32", "bfloat16", "float16").
    max_shard_bytes: the most bytes of tensors per file.
    write: False on processes other than the writing one: they only join the gathers.

  Returns:
    `{"files": [names], "total_size": bytes, "tensors": count}`.
  """
  want = _NP_DTYPES[dtype]
  groups = plan_shards(entries_of(params, tensors, dtype=dtype), max_shard_bytes)
  weight_map = {}
  for index, group in enumerate(groups):
    name = shard_name(index, len(groups))
    held = {}
    for entry in group:  # one parameter fetched at a time; the shard's tensors only
      host = fetch(params[entry.param])
      if host.dtype != want:
        raise ExportError(f"parameter {entry.param} has dtype {host.dtype}, the config's "
                          f"model.param_dtype is {dtype}")
      held[entry.tensor.name] = np.ascontiguousarray(host.T if entry.tensor.transpose else host)
      weight_map[entry.tensor.name] = name
    if write:
      save_shard(held, os.path.join(directory, name))
    del held
  total = sum(e.nbytes for group in groups for e in group)
  if write and len(groups) > 1:
    tokenizer_lib.write_json(os.path.join(directory, hf_weights.INDEX_NAME),
               {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
  return {"files": [shard_name(i, len(groups)) for i in range(len(groups))],
          "total_size": total, "tensors": len(weight_map)}


def write_files(directory: str, config: Any, workdir: str, *,
                vocab_size: int) -> tuple[list[str], bool]:
  """Everything but the weights: the tokenizer files, config.json, generation_config.json.

  `workdir`'s `hf_source` (an imported model's files, `train.hf.init_from.keep_source_files`) is the
  base of config.json, generation_config.json and the tokenizer; without it config.json is a
  fresh one of `model.family` and the tokenizer the run's (`write_tokenizer`).

  Returns:
    `(tokenizer file names, whether a chat template was written)`.
  """
  renderer = run_tokenizer.chat_renderer(config, workdir, stage=False)  # never a download
  out = Path(directory)
  source = Path(workdir) / hf_init.SOURCE_DIR
  source = source if (source / "config.json").is_file() else None
  template = tokenizer_lib.exported_template(renderer)
  names, ids = tokenizer_lib.write_tokenizer(out, config, source=source, template=template)
  base = tokenizer_lib._read_json(source / "config.json") if source is not None else None
  try:
    hf = hf_config.to_hf_config(config.model, vocab_size=vocab_size, base=base, special_ids=ids,
                                dtype=config.model.param_dtype, seq_len=config.packing.seq_len)
  except hf_config.HfModelError as e:
    raise ExportError(str(e)) from e
  tokenizer_lib.write_json(str(out / "config.json"), hf)
  write_generation_config(out, source=source, ids=ids,
                          stop_ids=() if renderer is None else renderer.stop_ids)
  return names, template is not None


def write_generation_config(out: Path, *, source: Path | None, ids: dict[str, Any],
                            stop_ids: Sequence[int]) -> None:
  """generation_config.json: an imported model's own (`source`), else the tokenizer's `ids`,
  with `stop_ids` (a chat run's end of turn) added to its EOS ids.

  `generate` then stops where the model was trained to end its turn. The source's file is copied
  byte for byte when it already lists every stop id.
  """
  path = None if source is None else source / "generation_config.json"
  kept = path is not None and path.is_file()
  generation = tokenizer_lib._read_json(path) if kept else dict(ids)
  eos = generation.get("eos_token_id")
  eos = [] if eos is None else [int(i) for i in (eos if isinstance(eos, list) else [eos])]
  added = [int(i) for i in dict.fromkeys(stop_ids) if int(i) not in eos]
  if kept and not added:
    shutil.copyfile(path, out / "generation_config.json")
    return
  if added:
    generation["eos_token_id"] = eos + added
  tokenizer_lib.write_json(str(out / "generation_config.json"), generation)

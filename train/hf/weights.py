"""Hugging Face safetensors weights <-> a `train.model.decoder.Decoder`'s parameters.

Names: `model.embed_tokens.weight` is `embed/embedding`, `model.layers.N.self_attn.q_proj.weight`
is `layers/N/attn/q/kernel` (transposed: torch Linear weights are `[out, in]`, Flax kernels
`[in, out]`), and so on (`tensor_map`). The rotary layout needs no permutation: both sides rotate
the two halves of each head vector (transformers' `rotate_half`, `train.model.rope.apply_rope`).

Algorithm of `load_params`:
  1. Index: `model.safetensors.index.json` (every file it names must exist), else the one
     `model.safetensors`; each file's header is read (shapes, dtypes) through `safetensors`.
  2. Check: every parameter of the model has its tensor, of the right shape and a float dtype; a
     tensor the model has no place for is an error (it would be a feature silently dropped),
     except rotary caches (`rotary_emb.inv_freq`) and a tied model's duplicate `lm_head.weight`.
  3. Place: each parameter is made with `jax.make_array_from_callback` on its `NamedSharding`;
     the callback opens the file memory-mapped, reads only the device's slice of that one tensor
     (transposed where needed), casts it to the parameter dtype and closes the map, so host
     memory holds one slice at a time, never the checkpoint.

Example: a tied Qwen2 checkpoint of 2 layers has 2 * 12 + 2 tensors; its `lm_head.weight`
is absent, `layers/0/attn/q/bias` reads `model.layers.0.self_attn.q_proj.bias` as it is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from train.hf import config as hf_config
from train.model import decoder as model_lib
from train import sharding as sharding_lib

from segpack import errors

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_FLOAT_CODES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """Where one parameter lives in a Hugging Face checkpoint: its name, and whether the torch
  tensor is the transpose of the Flax parameter."""
  name: str
  transpose: bool = False


def tensor_map(*, num_layers: int, qkv_bias: bool, qk_norm: bool,
               tie_embeddings: bool) -> dict[str, Tensor]:
  """segpack parameter path (`layers/0/attn/q/kernel`) -> its Hugging Face tensor."""
  out = {"embed/embedding": Tensor("model.embed_tokens.weight"),
         "final_norm/scale": Tensor("model.norm.weight")}
  if not tie_embeddings:
    out["lm_head/kernel"] = Tensor("lm_head.weight", transpose=True)
  for n in range(num_layers):
    ours, theirs = f"layers/{n}", f"model.layers.{n}"
    out[f"{ours}/attn_norm/scale"] = Tensor(f"{theirs}.input_layernorm.weight")
    out[f"{ours}/mlp_norm/scale"] = Tensor(f"{theirs}.post_attention_layernorm.weight")
    for proj in ("q", "k", "v", "o"):
      out[f"{ours}/attn/{proj}/kernel"] = Tensor(f"{theirs}.self_attn.{proj}_proj.weight", True)
    for proj in ("gate", "up", "down"):
      out[f"{ours}/mlp/{proj}/kernel"] = Tensor(f"{theirs}.mlp.{proj}_proj.weight", True)
    if qkv_bias:
      for proj in ("q", "k", "v"):
        out[f"{ours}/attn/{proj}/bias"] = Tensor(f"{theirs}.self_attn.{proj}_proj.bias")
    if qk_norm:
      for proj in ("q", "k"):
        out[f"{ours}/attn/{proj}_norm/scale"] = Tensor(f"{theirs}.self_attn.{proj}_norm.weight")
  return out


def model_tensor_map(model_cfg: Any) -> dict[str, Tensor]:
  """`tensor_map` of a trainer config's `model` group (or a `DecoderConfig`)."""
  return tensor_map(num_layers=model_cfg.num_layers, qkv_bias=bool(model_cfg.qkv_bias),
                    qk_norm=bool(model_cfg.qk_norm),
                    tie_embeddings=bool(model_cfg.tie_embeddings))


def _safe_open(path: str):
  try:
    from safetensors import safe_open  # optional: Hugging Face interop only (extra segpack[hf])
  except ImportError as e:
    raise hf_config.HfModelError(f"model.init_from needs the safetensors package: pip install "
                                 f"'segpack[hf]' ({e})") from e
  try:
    return safe_open(path, framework="numpy")
  except Exception as e:  # safetensors raises its own SafetensorError / OSError types.
    raise hf_config.HfModelError(
        f"{path}: not a readable safetensors file ({errors.one_line(e)[:200]})") from e


def _index(model_dir: str) -> dict[str, str]:
  """Tensor name -> the safetensors file holding it (step 1 of the module's algorithm)."""
  index_path = os.path.join(model_dir, INDEX_NAME)
  if os.path.isfile(index_path):
    try:
      with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
      assert isinstance(weight_map, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
      raise hf_config.HfModelError(f"{index_path}: no readable weight_map ({e!r:.200})") from e
    files = {}
    for name, file in weight_map.items():
      path = os.path.join(model_dir, os.path.basename(str(file)))
      if not os.path.isfile(path):
        raise hf_config.HfModelError(f"{index_path} names {file!r} (for {name}), which does not "
                                     f"exist in {model_dir}")
      files[name] = path
    return files
  single = os.path.join(model_dir, SINGLE_NAME)
  if not os.path.isfile(single):
    raise hf_config.HfModelError(f"model.init_from={model_dir!r} has neither {SINGLE_NAME} nor "
                                 f"{INDEX_NAME}")
  with _safe_open(single) as f:
    return dict.fromkeys(f.keys(), single)


def _headers(files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
  """Tensor name -> (shape, dtype code) from every file's header; checks each file's size."""
  out = {}
  for path in sorted(set(files.values())):
    with _safe_open(path) as f:
      for name in f.keys():
        piece = f.get_slice(name)
        out[name] = (tuple(piece.get_shape()), piece.get_dtype())
  missing = sorted(set(files) - set(out))
  if missing:
    raise hf_config.HfModelError(f"{INDEX_NAME} names {missing[0]!r} in {files[missing[0]]}, "
                                 f"which does not hold it")
  return out


def _check_tied_head(files: dict[str, str], headers: dict[str, Any], rows: int = 8192) -> None:
  """A config that ties the output projection to the embedding, with a stored `lm_head.weight`
  that differs from it: transformers 5 keeps the stored head, so dropping it would import
  another model; refused by name (compared a block of rows at a time)."""
  head, table = "lm_head.weight", "model.embed_tokens.weight"
  if table not in headers or headers[head][0] != headers[table][0]:
    return
  with _safe_open(files[head]) as a, _safe_open(files[table]) as b:
    x, y = a.get_slice(head), b.get_slice(table)
    n = headers[head][0][0]
    for start in range(0, n, rows):
      stop = min(start + rows, n)
      if not np.array_equal(x[start:stop], y[start:stop]):
        raise hf_config.HfModelError(
            f"{files[head]}: config.json ties the output projection to the embedding "
            f"(tie_word_embeddings), but its stored {head} differs from {table} (from row "
            f"{start}); transformers uses the stored head, so segpack would import another "
            f"model: set tie_word_embeddings to false in config.json to import both")


def check_tensors(model_dir: str, expected: dict[str, Tensor],
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
  """Steps 1-2 of the module's algorithm; returns tensor name -> file for `expected`."""
  files = _index(model_dir)
  headers = _headers(files)
  wanted = {t.name for t in expected.values()}
  extra = [n for n in headers if n not in wanted and not n.endswith(_IGNORED_SUFFIXES)
           and not (n == "lm_head.weight" and "lm_head/kernel" not in expected)]
  if extra:
    raise hf_config.HfModelError(
        f"{model_dir}: tensor {sorted(extra)[0]!r} ({len(extra)} unexpected in all) has no "
        f"place in the model config.json describes; refusing rather than dropping it")
  if "lm_head.weight" in headers and "lm_head/kernel" not in expected:
    _check_tied_head(files, headers)
  for path, tensor in expected.items():
    if tensor.name not in headers:
      raise hf_config.HfModelError(f"{model_dir}: tensor {tensor.name!r} is missing from its "
                                   f"safetensors files")
    shape, code = headers[tensor.name]
    want = tuple(reversed(shapes[path])) if tensor.transpose else tuple(shapes[path])
    if shape != want:
      raise hf_config.HfModelError(f"{files[tensor.name]}: tensor {tensor.name!r} has shape "
                                   f"{list(shape)}, config.json implies {list(want)}")
    if code not in _FLOAT_CODES:
      raise hf_config.HfModelError(f"{files[tensor.name]}: tensor {tensor.name!r} has dtype "
                                   f"{code}; only float32, bfloat16 and float16 are supported")
  return {t.name: files[t.name] for t in expected.values()}


def slice_reader(path: str, tensor: Tensor, dtype: Any):
  """The `make_array_from_callback` callback of one parameter (step 3).

  The callback maps the file, views the tensor in the map (its offset from the safetensors
  header, whose shapes and dtypes `check_tensors` has checked), and copies the device's slice,
  transposed and cast in the one copy, into a 64-byte aligned buffer, which JAX's CPU client
  adopts without a copy; then it closes the map. Host memory above the parameters is the slice's
  mapped pages while they are copied: no copy by `safetensors` and no intermediate array (a
  transpose or cast made apart, whose freed blocks the allocator may keep).
  """
  def read(index: tuple[slice, ...]) -> np.ndarray:
    theirs = tuple(reversed(index)) if tensor.transpose else index
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
      size = int.from_bytes(mm[:8], "little")
      entry = json.loads(mm[8:8 + size])[tensor.name]
      file_dtype = np.dtype(NP_DTYPES[_FLOAT_CODES[entry["dtype"]]])
      start, end = (8 + size + int(o) for o in entry["data_offsets"])
      count = math.prod(entry["shape"])
      if end - start != count * file_dtype.itemsize or end > len(mm):
        raise hf_config.HfModelError(f"{path}: tensor {tensor.name!r} has data_offsets "
                                     f"{entry['data_offsets']} that do not hold its shape "
                                     f"{entry['shape']} of {entry['dtype']} in the file")
      whole = np.frombuffer(mm, file_dtype, count, start).reshape(entry["shape"])
      block = whole[theirs].T if tensor.transpose else whole[theirs]
      nbytes = block.size * np.dtype(dtype).itemsize
      raw = np.empty(nbytes + 64, np.uint8)
      first = -raw.ctypes.data % 64
      out = raw[first:first + nbytes].view(dtype).reshape(block.shape)
      np.copyto(out, block, casting="unsafe")
      del whole, block  # the map closes only once no array views it.
    if not np.isfinite(out).all():  # found here, not blamed on the learning rate at step 1
      raise hf_config.HfModelError(f"{path}: tensor {tensor.name!r} holds NaN or infinite "
                                   f"values ({int((~np.isfinite(out)).sum())} in the slice "
                                   f"{index} read here)")
    return out
  return read


def load_params(model_dir: str, abstract_params: Any, shardings: Any, model_cfg: Any) -> Any:
  """The Hugging Face checkpoint in `model_dir` as parameters shaped like `abstract_params`.

  Args:
    model_dir: the model directory (`model.init_from`).
    abstract_params: the model's parameter shapes (`nnx.split(nnx.eval_shape(...))[1]`).
    shardings: their `NamedSharding`s (`train.sharding.param_shardings`).
    model_cfg: the config's `model` group after `hf_config.adopt`.

  Raises:
    HfModelError: a missing, extra, misshapen or unreadable tensor, naming it and its file.
  """
  expected = model_tensor_map(model_cfg)
  flat = sharding_lib.flat_params(abstract_params)
  unknown = sorted(set(flat) - set(expected))
  if unknown:
    raise hf_config.HfModelError(f"parameter {unknown[0]} has no Hugging Face tensor")
  files = check_tensors(model_dir, expected, {p: flat[p].shape for p in expected})

  def place(path, abstract, sharding):
    tensor = expected[sharding_lib.param_name(path)]
    return jax.make_array_from_callback(
        abstract.shape, sharding,
        slice_reader(files[tensor.name], tensor, NP_DTYPES[str(np.dtype(abstract.dtype))]))

  return jax.tree_util.tree_map_with_path(place, abstract_params, shardings)


def load_decoder(config: Any, *, mesh: Any) -> Any:
  """The `train.model.decoder.Decoder` of `config.model.init_from` with its weights, on `mesh`.

  `config` must have gone through `hf_config.adopt`; the parameters are placed with
  `train.sharding.param_shardings` (for sampling, export checks and tests; the trainer places
  them through `load_params` inside its own state).
  """
  abstract = model_lib.abstract(config, mesh=mesh)
  graphdef, abstract_params = nnx.split(abstract)
  params = load_params(config.model.init_from, abstract_params,
                       sharding_lib.param_shardings(abstract_params, mesh), config.model)
  return nnx.merge(graphdef, params)

"""A Hugging Face `config.json` read as the trainer's `model` keys, and written back on export.

Families: `llama` (Llama 2, 3, 3.1+ with `rope_scaling` `llama3` or `linear`), `mistral`, `qwen2`
(Qwen2 / 2.5: biases on q, k, v) and `qwen3` (RMSNorm of every query and key head). Anything else
is refused by name, never approximated: another `model_type` (Gemma's embedding scale, `(1 + w)`
norms and soft-capping included), a `rope_scaling` type other than `linear` / `llama3`, an
activation other than SiLU, biases on the output or MLP projections, mixture-of-experts, a
quantized checkpoint. A sliding window is kept (`model.sliding_window`) and rows longer than it
are refused where the row length is known (`check_window`).

RoPE settings are read from both places transformers has kept them: `rope_theta` / `rope_scaling`
(4.x, with `rope_type` or the older `type`) and `rope_parameters` (5.x); they must agree. Export
writes both, so that neither version falls back to a default silently.

Export (`to_hf_config`) is `architecture` read backwards: the `model.*` keys become config.json
fields (on top of the imported model's own config.json when there is one), and
`architecture(to_hf_config(...))` gives the keys back.

Algorithm of `adopt` (what `--config.model.init_from=DIR` does to a config):
  1. Read `DIR/config.json` and turn it into values of `model.*` keys (`architecture`).
  2. A key the command line set explicitly to another value is an error naming both values.
  3. Every key takes the checkpoint's value; `model.param_dtype` takes the checkpoint's dtype
     (float32 for a float16 checkpoint: float16 master weights stop training at its first
     steps) unless the command line set it.

Example: a Qwen2 config.json with `hidden_size: 896`, `num_key_value_heads: 2` gives
`model.d_model=896`, `model.num_kv_heads=2`, `model.qkv_bias=True`, `model.family="qwen2"`;
`--config.model.d_model=512` beside it stops the run: "model.d_model=512 contradicts ... 896".
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

from segpack import errors
from segpack.errors import UserError
from configs import architecture as architecture_lib

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
CONFIG_NAME = "config.json"
# Families refused by name, with the reason (what segpack's decoder does not compute).
_REFUSED = {
    "gemma": "embeddings scaled by sqrt(hidden_size), (1 + w) RMSNorm, GeLU",
    "gemma2": "logit soft-capping, alternating local/global attention, (1 + w) RMSNorm",
    "gemma3": "alternating local/global attention with two RoPE bases, (1 + w) RMSNorm",
    "gemma3_text": "alternating local/global attention with two RoPE bases, (1 + w) RMSNorm",
    "mixtral": "mixture-of-experts feed-forward layers",
    "qwen2_moe": "mixture-of-experts feed-forward layers",
    "qwen3_moe": "mixture-of-experts feed-forward layers",
}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# The architecture keys `adopt` sets (top-level `model.*` keys; rope_scaling is a group of
# SCALING_KEYS): `configs.architecture` declares them.
ARCH_KEYS = architecture_lib.checkpoint_keys()
SCALING_KEYS = architecture_lib.scaling_keys()


class HfModelError(UserError, ValueError):
  """A Hugging Face model directory segpack cannot load exactly (printed as one line, rc 2)."""


def read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
  """`model_dir/config.json` as a dict; HfModelError naming the path when absent or not JSON."""
  model_dir = os.fspath(model_dir)
  if not os.path.isdir(model_dir):
    raise HfModelError(f"model.init_from={model_dir!r} is not a directory")
  path = os.path.join(model_dir, CONFIG_NAME)
  if not os.path.isfile(path) and os.path.isfile(os.path.join(model_dir, "run.json")):
    raise HfModelError(
        f"model.init_from={model_dir!r} is a segpack run (run.json, checkpoints/), not a Hugging "
        f"Face model directory; export it first and start from the export: python -m "
        f"train.export --workdir {model_dir} --output EXPORTED, then "
        f"--config.model.init_from=EXPORTED")
  if not os.path.isfile(path):
    raise HfModelError(f"model.init_from={model_dir!r} has no {CONFIG_NAME} (a Hugging Face "
                       f"model directory holds config.json, *.safetensors and tokenizer files)")
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise HfModelError(f"{path}: not readable JSON ({errors.one_line(e)})") from e
  if not isinstance(config, dict):
    raise HfModelError(f"{path}: expected a JSON object, got {type(config).__name__}")
  return config


def _field(hf: dict[str, Any], key: str, where: str, *, kind: type | tuple[type, ...] = int,
           default: Any = ..., positive: bool = False) -> Any:
  """`hf[key]`, of type `kind` (a finite number > 0 with `positive`); None stays None when it is
  the default."""
  value = hf.get(key, default)
  if value is ...:
    raise HfModelError(f"{where}: {key} is missing")
  if value is None and default is None:
    return None
  ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
  if not ok:
    name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    raise HfModelError(f"{where}: {key}={value!r} is not a{'' if kind is not int else 'n'} "
                       f"{name}")
  if positive and not (math.isfinite(value) and value > 0):
    raise HfModelError(f"{where}: {key}={value!r} is not a finite number > 0")
  return value


def _refuse_features(hf: dict[str, Any], family: str, where: str) -> None:
  """One error per feature segpack's decoder does not compute (the field and its value)."""
  checks = [
      ("quantization_config", hf.get("quantization_config") is not None,
       "quantized checkpoints are not supported"),
      ("num_experts", bool(hf.get("num_experts")), "mixture-of-experts is not supported"),
      ("num_local_experts", bool(hf.get("num_local_experts")),
       "mixture-of-experts is not supported"),
      ("hidden_act", hf.get("hidden_act", "silu") not in ("silu", "swish"),  # one function
       "only the SiLU (SwiGLU) feed-forward is supported"),
      ("mlp_bias", bool(hf.get("mlp_bias")), "biases on the MLP projections are not supported"),
      ("attention_bias", family != "qwen2" and bool(hf.get("attention_bias")),
       "biases on the attention projections (o_proj included) are not supported"),
  ]
  for key, bad, why in checks:
    if bad:
      raise HfModelError(f"{where}: {key}={hf.get(key)!r}: {why}")


def _rope(hf: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
  """`(rope_theta, model.rope_scaling values)` from `rope_scaling` and/or `rope_parameters`."""
  params = hf.get("rope_parameters")
  legacy = hf.get("rope_scaling")
  for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
    if value is not None and not isinstance(value, dict):
      raise HfModelError(f"{where}: {key}={value!r} is not an object")
  theta = hf.get("rope_theta", (params or {}).get("rope_theta", 10_000.0))
  for key, value in (("rope_parameters.rope_theta", (params or {}).get("rope_theta", theta)),
                     ("rope_theta", theta)):
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
        or not math.isfinite(value) or value <= 1):
      raise HfModelError(f"{where}: {key}={value!r} is not a finite number > 1")
  if params and "rope_theta" in params and float(params["rope_theta"]) != float(theta):
    raise HfModelError(f"{where}: rope_theta={theta!r} and rope_parameters.rope_theta="
                       f"{params['rope_theta']!r} disagree")
  scaling = legacy if legacy else {k: v for k, v in (params or {}).items() if k != "rope_theta"}
  kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
  out = dict(type=None, factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=None)
  if kind in (None, "default"):
    return float(theta), out
  if kind not in ("linear", "llama3"):
    raise HfModelError(f"{where}: rope_scaling type {kind!r} is not supported (segpack "
                       f"computes 'linear' and 'llama3'; refusing rather than training a "
                       f"different model)")
  out.update(type=kind, factor=float(_field(scaling, "factor", where + " rope_scaling",
                                            kind=(int, float))))
  if kind == "llama3":
    for key in ("low_freq_factor", "high_freq_factor"):
      out[key] = float(_field(scaling, key, where + " rope_scaling", kind=(int, float)))
    out["original_max_position_embeddings"] = _field(
        scaling, "original_max_position_embeddings", where + " rope_scaling")
  return float(theta), out


def _sliding_window(hf: dict[str, Any], family: str, where: str) -> int | None:
  """The attention window of the checkpoint's layers (None: full attention everywhere)."""
  window = hf.get("sliding_window")
  if family == "llama" or (family in ("qwen2", "qwen3")
                           and not hf.get("use_sliding_window", False)):
    return None  # transformers' Llama has no window: it ignores the field
  layer_types = hf.get("layer_types")
  if isinstance(layer_types, list) and all(t == "full_attention" for t in layer_types):
    return None
  if window is None:
    return None
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise HfModelError(f"{where}: sliding_window={window!r} is not a positive int")
  return window


def torch_dtype(hf: dict[str, Any], where: str) -> str:
  """The checkpoint's parameter dtype (`dtype` in transformers 5, `torch_dtype` before)."""
  value = hf.get("dtype", hf.get("torch_dtype", "float32"))
  if value not in _DTYPES:
    raise HfModelError(f"{where}: torch_dtype={value!r} is not one of {sorted(_DTYPES)}")
  return _DTYPES[value]


def architecture(hf: dict[str, Any], *, where: str) -> dict[str, Any]:
  """The `model.*` values a Hugging Face config describes (keys `ARCH_KEYS`, plus
  `rope_scaling`, a dict of `SCALING_KEYS`). Raises HfModelError for anything unsupported."""
  family = hf.get("model_type")
  if family in _REFUSED:
    raise HfModelError(f"{where}: model_type={family!r} is not supported ({_REFUSED[family]}); "
                       f"segpack imports {', '.join(FAMILIES)}")
  if family not in FAMILIES:
    raise HfModelError(f"{where}: model_type={family!r} is not supported; segpack imports "
                       f"{', '.join(FAMILIES)}")
  _refuse_features(hf, family, where)
  count = functools.partial(_field, where=where, positive=True)
  d_model = count(hf, "hidden_size")
  num_heads = count(hf, "num_attention_heads")
  head_dim = count(hf, "head_dim", default=None) or d_model // num_heads
  theta, scaling = _rope(hf, where)
  return dict(
      family=family, vocab_size=count(hf, "vocab_size"),
      num_layers=count(hf, "num_hidden_layers"), d_model=d_model, num_heads=num_heads,
      num_kv_heads=count(hf, "num_key_value_heads", default=num_heads),
      head_dim=int(head_dim), d_ff=count(hf, "intermediate_size"), rope_theta=theta,
      norm_eps=float(count(hf, "rms_norm_eps", kind=(int, float))),
      tie_embeddings=bool(_field(hf, "tie_word_embeddings", where, kind=bool, default=False)),
      qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
      sliding_window=_sliding_window(hf, family, where),
      max_position_embeddings=count(hf, "max_position_embeddings", default=None),
      rope_scaling=scaling)


def differences(model_cfg: Any, arch: dict[str, Any]) -> list[tuple[str, Any, Any]]:
  """`(key, config value, checkpoint value)` for every architecture key where the config's
  `model` group and `architecture(...)` differ; keys relative to `model` (`d_model`,
  `rope_scaling.type`)."""
  pairs = [(key, model_cfg[key], arch[key]) for key in ARCH_KEYS]
  pairs += [(f"rope_scaling.{key}", model_cfg.rope_scaling[key], arch["rope_scaling"][key])
            for key in SCALING_KEYS]
  return [(key, ours, theirs) for key, ours, theirs in pairs if ours != theirs]


def _explicit_conflicts(model_cfg: Any, arch: dict[str, Any], explicit: set[str],
                        where: str) -> None:
  for key, ours, theirs in differences(model_cfg, arch):
    if f"model.{key}" in explicit:
      raise HfModelError(f"--config.model.{key}={ours!r} contradicts {where}, which says "
                         f"{theirs!r} (the architecture comes from model.init_from; leave the "
                         f"key unset)")


def adopt(config: Any, *, explicit: set[str] | frozenset[str] = frozenset()) -> None:
  """With `config.model.init_from` set, makes the config's model keys the checkpoint's.

  Args:
    config: a trainer config (edited in place; a locked ConfigDict accepts it).
    explicit: the dotted keys the command line set (`model.d_model`, ...); one of them that
      contradicts the checkpoint is an error naming both values.

  Raises:
    HfModelError: no usable config.json, an unsupported model, or a contradiction.
  """
  model_dir = config.model.init_from
  if model_dir is None:
    return
  where = os.path.join(model_dir, CONFIG_NAME)
  hf = read_config(model_dir)
  arch = architecture(hf, where=where)
  _explicit_conflicts(config.model, arch, set(explicit), where)
  dtype = torch_dtype(hf, where)
  if "model.param_dtype" not in explicit:  # float16 master weights overflow in AdamW's update
    config.model.param_dtype = "float32" if dtype == "float16" else dtype
  set_architecture(config.model, arch)


def set_architecture(model_cfg: Any, arch: dict[str, Any]) -> None:
  """Writes `architecture(...)`'s values into a config's `model` group (in place)."""
  for key in ARCH_KEYS:
    model_cfg[key] = arch[key]
  for key in SCALING_KEYS:
    model_cfg.rope_scaling[key] = arch["rope_scaling"][key]


def check_window(model_cfg: Any, seq_len: int) -> None:
  """Refuses rows longer than the model's sliding window (segpack attends to the whole row)."""
  window = model_cfg.sliding_window
  if window is not None and seq_len > window:
    raise HfModelError(
        f"packing.seq_len={seq_len} is longer than the model's sliding window "
        f"model.sliding_window={window}: segpack attends to the whole segment, so the model "
        f"would differ; use packing.seq_len <= {window}")


# The transformers class of each family (config.json's `architectures`).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The fields of config.json that say whether (and which) layers use a sliding window.
_WINDOW_FIELDS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")


def _rope_fields(model_cfg: Any) -> dict[str, Any]:
  """`rope_theta` and `rope_scaling` (transformers 4.x; both `rope_type` and the older `type`)
  and `rope_parameters` (5.x) of the config's `model.rope_theta` / `model.rope_scaling`."""
  theta = float(model_cfg.rope_theta)
  scaling_cfg = model_cfg.rope_scaling
  kind = scaling_cfg.type
  if kind is None:
    return dict(rope_theta=theta, rope_scaling=None,
                rope_parameters=dict(rope_type="default", rope_theta=theta))
  if kind not in ("linear", "llama3"):
    raise HfModelError(f"model.rope_scaling.type={kind!r} has no Hugging Face equivalent "
                       f"(export writes 'linear' and 'llama3')")
  scaling = dict(factor=float(scaling_cfg.factor))
  if kind == "llama3":
    scaling.update(low_freq_factor=float(scaling_cfg.low_freq_factor),
                   high_freq_factor=float(scaling_cfg.high_freq_factor),
                   original_max_position_embeddings=int(
                       scaling_cfg.original_max_position_embeddings))
  return dict(rope_theta=theta, rope_scaling=dict(rope_type=kind, type=kind, **scaling),
              rope_parameters=dict(rope_type=kind, rope_theta=theta, **scaling))


def _window_fields(family: str, window: int | None, num_layers: int) -> dict[str, Any]:
  """The sliding-window fields of a fresh config (`_sliding_window` reads them back)."""
  if family in ("qwen2", "qwen3"):
    kind = "full_attention" if window is None else "sliding_attention"
    return dict(use_sliding_window=window is not None, sliding_window=window,
                max_window_layers=num_layers if window is None else 0,
                layer_types=[kind] * num_layers)
  if family == "mistral" or window is not None:  # Mistral's absent window means 4096
    return dict(sliding_window=window)
  return {}


def _check_family(model_cfg: Any) -> str:
  """The family, after checking the q/k/v biases and q/k norms are the family's own."""
  family = model_cfg.family
  if family not in FAMILIES:
    raise HfModelError(f"model.family={family!r} is not one export writes ({', '.join(FAMILIES)})")
  for key, owner in (("qkv_bias", "qwen2"), ("qk_norm", "qwen3")):
    if bool(model_cfg[key]) != (family == owner):
      raise HfModelError(
          f"model.{key}={bool(model_cfg[key])!r} with model.family={family!r}: in Hugging Face "
          f"models only {owner} has {'biases on q, k, v' if owner == 'qwen2' else 'q/k norms'}"
          f" (set model.family={owner!r} for them, or model.{key}={family == owner!r})")
  return family


def to_hf_config(model_cfg: Any, *, vocab_size: int, base: dict[str, Any] | None,
                 special_ids: dict[str, Any], dtype: str,
                 seq_len: int | None = None) -> dict[str, Any]:
  """The config.json of a model with the keys of a trainer config's `model` group.

  Algorithm:
    1. Start from `base` (an imported model's config.json: its other fields, e.g. the
       initializer range or the transformers version, stay) or a fresh config of the family.
    2. Write the architecture fields `architecture` reads (sizes, norm epsilon, tying, RoPE in
       both the 4.x and 5.x places, the sliding window; `base`'s window fields are kept when they
       already describe the same window) and the dtype (`torch_dtype` and `dtype`).
    3. Write `special_ids` (`bos_token_id`, `eos_token_id`, `pad_token_id`) as given.

  Example: a llama-family `model` group with `d_model=64`, `tie_embeddings=True` gives
  `{"model_type": "llama", "hidden_size": 64, "tie_word_embeddings": true, ...}`, and
  `architecture` of that dict gives `d_model=64, tie_embeddings=True` back.

  Args:
    model_cfg: the config's `model` group (after `adopt` for an imported model).
    vocab_size: the embedding's rows (the trained vocabulary, whatever `model.vocab_size` says).
    base: the imported model's config.json, or None for a model trained from scratch.
    special_ids: config.json's special-token fields to write (absent keys are left alone).
    dtype: the parameters' dtype (`model.param_dtype`): "float32", "bfloat16" or "float16".
    seq_len: `max_position_embeddings` when `model.max_position_embeddings` is None.

  Raises:
    HfModelError: a family, feature or dtype that has no Hugging Face equivalent.
  """
  family = _check_family(model_cfg)
  if dtype not in _DTYPES:
    raise HfModelError(f"model.param_dtype={dtype!r} is not one of {sorted(_DTYPES)}")
  fresh = base is None
  out = dict(base) if base is not None else dict(
      initializer_range=float(model_cfg.init_std), use_cache=True, attention_dropout=0.0)
  num_layers = int(model_cfg.num_layers)
  window = model_cfg.sliding_window
  out.update(
      model_type=family, architectures=[ARCHITECTURES[family]], vocab_size=int(vocab_size),
      hidden_size=int(model_cfg.d_model), num_hidden_layers=num_layers,
      num_attention_heads=int(model_cfg.num_heads),
      num_key_value_heads=int(model_cfg.num_kv_heads), head_dim=int(model_cfg.head_dim),
      intermediate_size=int(model_cfg.d_ff), hidden_act="silu",
      rms_norm_eps=float(model_cfg.norm_eps), tie_word_embeddings=bool(model_cfg.tie_embeddings),
      max_position_embeddings=int(model_cfg.max_position_embeddings or seq_len or 0) or None,
      torch_dtype=dtype, dtype=dtype, **_rope_fields(model_cfg))
  if family in ("llama", "qwen3"):
    out["attention_bias"] = False
  if family == "llama":
    out["mlp_bias"] = False
  if fresh or _sliding_window(base, family, "config.json") != window:
    for key in _WINDOW_FIELDS:
      out.pop(key, None)
    out.update(_window_fields(family, window, num_layers))
  out.update(special_ids)
  return out

"""PEFT LoRA adapter directories (Hugging Face `peft`), read and written.

A directory holds `adapter_config.json` (a `LoraConfig`: `peft_type` "LORA", `r`, `lora_alpha`,
`target_modules`, ...) and `adapter_model.safetensors`, whose keys are what `save_pretrained`
writes for a causal LM of the Llama family (Llama, Qwen2, Qwen3, Mistral):
`base_model.model.model.layers.{i}.{module}.lora_A.weight` `[r, in]` and `...lora_B.weight`
`[out, r]`, torch-oriented. Our arrays are Flax-oriented: `a_IxR` is lora_A's weight transposed,
`b_RxO` lora_B's; the adapter adds `x @ a_IxR @ b_RxO * scale` to its projection's output,
`scale = alpha / r` (`alpha / sqrt(r)` with rsLoRA).

Reading accepts what peft writes for a plain LoRA of those projections: `target_modules` as a
list (matched as peft matches it: a module's name or a dotted suffix of it), a regex (matched
whole against `model.layers.{i}.{module}`) or "all-linear"; keys with or without an adapter name
(`lora_A.default.weight`). Anything that would change the forward pass beyond `x @ A @ B * scale`
(DoRA and the other variants, biases, per-module ranks or alphas, modules saved whole, other
modules adapted) is refused in one line naming the file, the key and the value, as is a weight
that is missing, unexpected, misshapen, not finite or not a float.

Example: r=4, alpha=8 on q_proj and v_proj of a 2-layer model is 8 tensors; `read_adapter`
gives `AdapterSpec(rank=4, alpha=8.0, targets=("q", "v"))` (scale 2.0) and
`{(0, "q"): (a_IxR, b_RxO), (0, "v"): ..., (1, "q"): ..., (1, "v"): ...}`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import ml_dtypes
import numpy as np

from segpack.errors import UserError

__all__ = ["CONFIG_NAME", "TARGETS", "WEIGHTS_NAME", "AdapterError", "AdapterSpec",
           "read_adapter", "weight_key", "write_adapter"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# Our projection names -> their modules in a decoder layer of a Llama-like model.
TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
_BY_MODULE = {module: name for name, module in TARGETS.items()}
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[\w-]+)?\.weight")
_LAYER_MODULE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<module>.+)")
# Modules that are no decoder projection but that a regex of target_modules might adapt.
_OTHER_MODULES = ("lm_head", "model.embed_tokens")
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")
# Config keys whose set values change what an adapter computes: (key, what a set value asks for).
_REFUSED = (
    ("use_dora", "DoRA"),
    ("use_qalora", "QA-LoRA's pooled inputs"),
    ("use_bdlora", "block-diagonal LoRA"),
    ("velora_config", "a LoRA variant"),
    ("monteclora_config", "a LoRA variant"),
    ("kasa_config", "a LoRA variant"),
    ("arrow_config", "routing between adapters"),
    ("alora_invocation_tokens", "activated LoRA (aLoRA)"),
    ("lora_bias", "a bias on lora_B"),
    ("rank_pattern", "per-module ranks"),
    ("alpha_pattern", "per-module alphas"),
    ("modules_to_save", "modules saved whole beside the adapter"),
    ("layers_to_transform", "adapters on some layers only"),
    ("exclude_modules", "modules excluded from target_modules"),
    ("layer_replication", "replicated layers"),
    ("trainable_token_indices", "trained token embeddings"),
    ("target_parameters", "adapted parameters (not modules)"),
)

Tensors = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


class AdapterError(UserError, ValueError):
  """A PEFT adapter directory that cannot be read (or adapter tensors that cannot be written)."""


def _safetensors() -> Any:
  """The `safetensors` package, or an AdapterError naming the extra that installs it."""
  try:
    import safetensors  # optional: only PEFT adapter files need it (extra segpack[hf])
    import safetensors.numpy  # optional: as above
  except ImportError as e:
    raise AdapterError(f"a PEFT adapter (model.init_adapter, train.export --adapter) needs the "
                       f"`{e.name or 'safetensors'}` package, which is not installed: pip "
                       f"install 'segpack[hf]'") from None
  return safetensors


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterSpec:
  """A LoRA adapter's settings, as peft's `LoraConfig` keys them.

  Attributes:
    rank: r, the inner dimension of every adapter.
    alpha: `lora_alpha`.
    targets: the adapted projections, our names (`TARGETS`), kept in `TARGETS` order.
    dropout: `lora_dropout`, used while training only.
    use_rslora: rank-stabilized scaling, `alpha / sqrt(rank)`.
    base_model: `base_model_name_or_path`, or None.
  """

  rank: int
  alpha: float
  targets: tuple[str, ...]
  dropout: float = 0.0
  use_rslora: bool = False
  base_model: str | None = None

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
      raise AdapterError(f"AdapterSpec rank must be a positive int, got rank={self.rank!r}")
    targets = tuple(self.targets)
    if not targets or len(set(targets)) != len(targets) or set(targets) - set(TARGETS):
      raise AdapterError(f"AdapterSpec targets must be distinct names from {list(TARGETS)}, "
                         f"got targets={self.targets!r}")
    object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))

  @property
  def scale(self) -> float:
    """What multiplies an adapter's output: `alpha / rank`, or `alpha / sqrt(rank)` (rsLoRA)."""
    return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def weight_key(*, layer: int, target: str, part: str) -> str:
  """The safetensors key of one factor ("A" or "B") as peft's `save_pretrained` writes it."""
  return f"base_model.model.model.layers.{layer}.{TARGETS[target]}.lora_{part}.weight"


def _config_dict(spec: AdapterSpec) -> dict[str, Any]:
  """`adapter_config.json` as peft's `LoraConfig.save_pretrained` writes it for plain LoRA."""
  return {
      "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": spec.base_model,
      "bias": "none", "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
      "init_lora_weights": True, "layer_replication": None, "layers_pattern": None,
      "layers_to_transform": None, "loftq_config": {},
      "lora_alpha": int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha,
      "lora_bias": False, "lora_dropout": spec.dropout, "megatron_config": None,
      "megatron_core": "megatron.core", "modules_to_save": None, "peft_type": "LORA",
      "r": spec.rank, "rank_pattern": {}, "revision": None,
      "target_modules": sorted(TARGETS[t].rsplit(".", 1)[1] for t in spec.targets),
      "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": spec.use_rslora,
  }


def _write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to `path`, created with the mode the umask leaves (0666 & ~umask)."""
  with open(path, "wb") as f:
    f.write(data)


def write_adapter(*, directory: str, spec: AdapterSpec, tensors: Tensors,
                  dtype: str = "float32") -> list[str]:
  """Writes a PEFT LoRA adapter (config and weights) into an existing directory.

  Args:
    directory: the directory; the caller stages and publishes it (the files are written in
      place, each created with the mode the umask leaves).
    spec: the adapter's settings.
    tensors: `(layer, target) -> (a_IxR, b_RxO)` for every target of `spec` in every layer
      from 0 to the last one given.
    dtype: the stored dtype of the weights: "float32", "bfloat16" or "float16".

  Returns:
    The paths written: `adapter_config.json`, then `adapter_model.safetensors`.

  Raises:
    AdapterError: a missing or unexpected (layer, target), a shape that disagrees with
      `spec.rank`, non-finite values, or an unknown dtype.
  """
  if dtype not in _DTYPES:
    raise AdapterError(f"dtype must be one of {list(_DTYPES)}, got dtype={dtype!r}")
  layers = 1 + max((layer for layer, _ in tensors), default=-1)
  expected = {(layer, t) for layer in range(layers) for t in spec.targets}
  if set(tensors) != expected or not expected:
    wrong = sorted(set(tensors) ^ expected)[:1] or ["none"]
    raise AdapterError(f"tensors must hold (layer, target) for each of targets={spec.targets} "
                       f"in layers 0..{layers - 1}; {wrong[0]} is missing or unexpected")
  out = {}
  for (layer, target), (a_IxR, b_RxO) in sorted(tensors.items()):
    a_IxR, b_RxO = np.asarray(a_IxR), np.asarray(b_RxO)
    if (a_IxR.ndim != 2 or b_RxO.ndim != 2 or a_IxR.shape[1] != spec.rank
        or b_RxO.shape[0] != spec.rank):
      raise AdapterError(f"tensors[{(layer, target)}] must be a_IxR [in, {spec.rank}] and b_RxO "
                         f"[{spec.rank}, out], got {a_IxR.shape} and {b_RxO.shape}")
    for part, x in (("A", a_IxR.T), ("B", b_RxO.T)):
      x = np.ascontiguousarray(x.astype(_DTYPES[dtype]))
      if not np.all(np.isfinite(x.astype(np.float32))):
        raise AdapterError(f"tensors[{(layer, target)}] lora_{part} has non-finite values "
                           f"(as {dtype})")
      out[weight_key(layer=layer, target=target, part=part)] = x
  config_path = os.path.join(directory, CONFIG_NAME)
  weights_path = os.path.join(directory, WEIGHTS_NAME)
  encoded = _safetensors().numpy.save(out, metadata={"format": "pt"})
  _write_bytes(config_path, (json.dumps(_config_dict(spec), indent=2, sort_keys=True)
                             + "\n").encode())
  _write_bytes(weights_path, encoded)
  return [config_path, weights_path]


def _is_unset(value: Any) -> bool:
  """Whether a config value is peft's default "off": absent, null, false, empty."""
  return value is None or value is False or (isinstance(value, (str, list, dict, tuple))
                                             and not value)


def _read_config(path: str) -> dict[str, Any]:
  """The JSON object of `adapter_config.json`, its plain-LoRA keys checked."""
  if not os.path.isfile(path):
    raise AdapterError(f"{path}: no such file (a PEFT LoRA adapter directory holds {CONFIG_NAME} "
                       f"and {WEIGHTS_NAME})")
  try:
    with open(path, encoding="utf-8") as f:
      cfg = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise AdapterError(f"{path}: not JSON ({e})") from None
  if not isinstance(cfg, dict):
    raise AdapterError(f"{path}: not a JSON object, got {type(cfg).__name__}")
  if cfg.get("peft_type") != "LORA":
    raise AdapterError(f"{path}: peft_type={cfg.get('peft_type')!r}; only a LoRA adapter "
                       f"(\"LORA\") is read")
  for key, what in _REFUSED:
    if not _is_unset(cfg.get(key)):
      raise AdapterError(f"{path}: {key}={cfg[key]!r} asks for {what}, which is not supported")
  if cfg.get("bias", "none") != "none":
    raise AdapterError(f"{path}: bias={cfg['bias']!r}; only bias \"none\" is supported")
  rank, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
  dropout = cfg.get("lora_dropout", 0.0)
  if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
    raise AdapterError(f"{path}: r={rank!r} must be a positive int")
  for key, value in (("lora_alpha", alpha), ("lora_dropout", dropout)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise AdapterError(f"{path}: {key}={value!r} must be a finite number")
  if not 0 <= dropout < 1:
    raise AdapterError(f"{path}: lora_dropout={dropout!r} must be in [0, 1)")
  if alpha <= 0:  # read before model.lora.alpha takes it: the file is named, not the key
    raise AdapterError(f"{path}: lora_alpha={alpha!r} must be > 0 (segpack scales adapters by "
                       f"lora_alpha / r)")
  if not isinstance(cfg.get("use_rslora", False), bool):
    raise AdapterError(f"{path}: use_rslora={cfg['use_rslora']!r} must be true or false")
  if not isinstance(cfg.get("base_model_name_or_path"), (str, type(None))):
    raise AdapterError(f"{path}: base_model_name_or_path={cfg['base_model_name_or_path']!r} "
                       f"must be a string or null")
  return cfg


def _order(slot: tuple[Any, ...]) -> tuple[Any, ...]:
  """Sorts `(layer, target, ...)` by layer, then in `TARGETS` order."""
  return (slot[0], list(TARGETS).index(slot[1])) + tuple(slot[2:])


def _module_name(layer: int, target: str) -> str:
  """A projection's module name in the causal LM, as peft matches target_modules against it."""
  return f"model.layers.{layer}.{TARGETS[target]}"


def _expected(path: str, target_modules: Any, num_layers: int) -> set[tuple[int, str]]:
  """The (layer, target) pairs that `target_modules` adapts, as peft matches it; refuses one
  that would adapt another module (the output head, the embedding, ...)."""
  pairs = [(layer, t) for layer in range(num_layers) for t in TARGETS]
  if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
    return set(pairs)
  if isinstance(target_modules, str):
    try:
      pattern = re.compile(target_modules)
    except re.error as e:
      raise AdapterError(f"{path}: target_modules={target_modules!r} is not a regex ({e})") from None
    other = [m for m in _OTHER_MODULES if pattern.fullmatch(m)]
    if other:
      raise AdapterError(f"{path}: target_modules={target_modules!r} adapts {other[0]}; only "
                         f"the projections {list(_BY_MODULE)} can be adapted")
    return {(layer, t) for layer, t in pairs if pattern.fullmatch(_module_name(layer, t))}
  if not isinstance(target_modules, list) or not all(isinstance(m, str) for m in target_modules):
    raise AdapterError(f"{path}: target_modules={target_modules!r} must be a list of module "
                       f"names or a regex")
  found = set()
  for entry in target_modules:
    hits = {(layer, t) for layer, t in pairs if _module_name(layer, t) == entry
            or _module_name(layer, t).endswith("." + entry)}
    if not hits:
      raise AdapterError(f"{path}: target_modules entry {entry!r} is not one of the projections "
                         f"{list(_BY_MODULE)} (of a {num_layers}-layer model)")
    found |= hits
  return found


def _load_factor(path: str, f: Any, key: str, rank: int, part: str) -> np.ndarray:
  """One lora_A `[r, in]` or lora_B `[out, r]` weight as float32, its dtype, shape and values
  checked."""
  dtype = f.get_slice(key).get_dtype()
  if dtype not in _FLOAT_CODES:
    raise AdapterError(f"{path}: {key} has dtype {dtype}; adapter weights must be floats "
                       f"({', '.join(_FLOAT_CODES)})")
  x = np.asarray(f.get_tensor(key)).astype(np.float32)
  rank_dim = 0 if part == "A" else 1
  if x.ndim != 2 or x.shape[rank_dim] != rank:
    want = f"[{rank}, in]" if part == "A" else f"[out, {rank}]"
    raise AdapterError(f"{path}: {key} has shape {list(x.shape)}; lora_{part} of r={rank} is "
                       f"{want}")
  if not np.all(np.isfinite(x)):
    raise AdapterError(f"{path}: {key} has non-finite values "
                       f"({int(np.sum(~np.isfinite(x)))} of {x.size})")
  return x


def _parse_key(path: str, key: str, num_layers: int) -> tuple[int, str, str]:
  """`(layer, target, "A" | "B")` of a weight key; refuses any other key."""
  match = _KEY.fullmatch(key)
  if match is None:
    raise AdapterError(f"{path}: key {key!r} is not a LoRA weight of a decoder projection "
                       f"(base_model.model.model.layers.N.MODULE.lora_A|lora_B.weight)")
  inner = _LAYER_MODULE.fullmatch(match["module"])
  if inner is None or inner["module"] not in _BY_MODULE:
    raise AdapterError(f"{path}: key {key!r} adapts {match['module']}; only the projections "
                       f"{list(_BY_MODULE)} of model.layers.N can be adapted")
  layer = int(inner["layer"])
  if layer >= num_layers:
    raise AdapterError(f"{path}: key {key!r} is of layer {layer}; the model has {num_layers} "
                       f"layers (0..{num_layers - 1})")
  return layer, _BY_MODULE[inner["module"]], match["part"]


def _read_weights(path: str, rank: int, num_layers: int) -> dict[tuple[int, str, str], np.ndarray]:
  """`(layer, target, part) -> factor` (torch-oriented, float32) of `adapter_model.safetensors`."""
  if not os.path.isfile(path):
    raise AdapterError(f"{path}: no such file (a PEFT LoRA adapter directory holds {CONFIG_NAME} "
                       f"and {WEIGHTS_NAME})")
  safetensors = _safetensors()
  factors, keys = {}, {}
  try:
    with safetensors.safe_open(path, framework="np") as f:
      for key in sorted(f.keys()):
        slot = _parse_key(path, key, num_layers)
        if slot in keys:
          raise AdapterError(f"{path}: keys {keys[slot]!r} and {key!r} are the same weight")
        keys[slot] = key
        factors[slot] = _load_factor(path, f, key, rank, slot[2])
  except safetensors.SafetensorError as e:
    raise AdapterError(f"{path}: not a readable safetensors file ({e})") from None
  return factors


def read_adapter(*, directory: str, num_layers: int) -> tuple[AdapterSpec, Tensors]:
  """Reads a PEFT LoRA adapter directory written for a model of `num_layers` decoder layers.

  Args:
    directory: holds `adapter_config.json` and `adapter_model.safetensors`.
    num_layers: the model's decoder layers; a weight of a layer past them is refused.

  Returns:
    `(spec, tensors)`: the settings, and `(layer, target) -> (a_IxR, b_RxO)` float32 for every
    projection `target_modules` adapts (every layer, unless a regex names some).

  Raises:
    AdapterError: in one line naming the file, the key and the value: a missing or unreadable
      file, a config that is not plain LoRA of the projections (module docstring), a weight that
      is missing, unexpected, of another layer or module, misshapen, not finite or not a float.
  """
  if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
    raise AdapterError(f"num_layers must be a positive int, got num_layers={num_layers!r}")
  config_path = os.path.join(directory, CONFIG_NAME)
  weights_path = os.path.join(directory, WEIGHTS_NAME)
  cfg = _read_config(config_path)
  rank = cfg.get("r", 8)
  expected = _expected(config_path, cfg.get("target_modules"), num_layers)
  factors = _read_weights(weights_path, rank, num_layers)
  for layer, target, part in sorted(factors, key=_order):
    if (layer, target) not in expected:
      raise AdapterError(f"{weights_path}: {weight_key(layer=layer, target=target, part=part)} "
                         f"is not adapted by {CONFIG_NAME}'s target_modules="
                         f"{cfg.get('target_modules')!r} (peft would ignore it)")
  for layer, target in sorted(expected, key=_order):
    for part in "AB":
      if (layer, target, part) not in factors:
        raise AdapterError(
            f"{weights_path}: no {weight_key(layer=layer, target=target, part=part)}, which "
            f"target_modules={cfg.get('target_modules')!r} adapts (a {num_layers}-layer model)")
  targets = tuple(t for t in TARGETS if any(t == target for _, target in expected))
  if not targets:
    raise AdapterError(f"{config_path}: target_modules={cfg.get('target_modules')!r} adapts "
                       f"no projection of a {num_layers}-layer model")
  spec = AdapterSpec(rank=rank, alpha=float(cfg.get("lora_alpha", 8)), targets=targets,
                     dropout=float(cfg.get("lora_dropout", 0.0)),
                     use_rslora=cfg.get("use_rslora", False),
                     base_model=cfg.get("base_model_name_or_path"))
  tensors = {(layer, t): (np.ascontiguousarray(factors[layer, t, "A"].T),
                          np.ascontiguousarray(factors[layer, t, "B"].T))
             for layer, t in sorted(expected, key=_order)}
  return spec, tensors

"""The decoder's configuration: `DecoderConfig` (the architecture plus the attention backend
that runs it) and its checks, built from a trainer config's `model` and `attention` groups; the
compute dtype, the mesh attention runs on, cuDNN's static bound on segments per row.

`train.model.decoder` builds the model from it (`build`, `abstract`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp

from segpack import attention as attention_lib
from segpack.errors import UserError
from train.model import layout as layout_lib
from configs.architecture import Architecture, Lora, LoraConfigError
from configs.architecture import RopeConfigError
from configs.architecture import REMATS
from configs.architecture import RopeScaling

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ModelConfigError(UserError, ValueError):
  """The model hyper-parameters are inconsistent."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(Architecture):
  """Hyper-parameters of `Decoder`: the architecture (`configs.architecture.Architecture`, whose
  fields are the config's `model.*` keys) and the attention backend that runs it.

  Plain and typed (no ml_collections in the model). At construction `dtype="auto"` becomes the
  platform's compute dtype and `attention_implementation=None` the platform's best backend, so
  the layers never decide again; `vocab_size` must be given.
  """

  # The backend; None: the best for the platform, resolved at construction (the field then holds
  # the concrete name, so the layers never decide again).
  attention_implementation: str | None = None
  # Mesh on which kernel backends (Pallas, cuDNN) run under `shard_map`: batch over
  # `segpack.mesh.BATCH_AXES`, heads over `TENSOR_AXIS` (`segpack.attention.backend_mesh`
  # decides; XLA is left to the jit partitioner). When its `CONTEXT_AXIS` has more than one
  # device, every backend runs under it with the sequence split over that axis.
  attention_mesh: Any = None
  # Pallas only (refused with another backend): the kernel settings, e.g.
  # `PallasOptions(interpret=True)` to run the kernels on the CPU, slowly; None: the defaults.
  attention_pallas: attention_lib.PallasOptions | None = None
  # cuDNN only, and required there: the static bound N on segments per row, from the data
  # (`build` passes `round_segment_bound(Data.segment_bound)`); the cuDNN backward's memory
  # grows as B*N*H*S*D, so there is no default.
  attention_cudnn_segment_bound: int | None = None

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                 "d_ff"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ModelConfigError(
          f"DecoderConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ModelConfigError(f"DecoderConfig.head_dim must be even for RoPE, got {self.head_dim}")
    impl = self.attention_implementation
    n = self.attention_cudnn_segment_bound
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
      raise ModelConfigError(
          f"DecoderConfig.attention_cudnn_segment_bound must be None or a positive int, got {n!r}")
    try:
      impl = attention_lib.resolve_implementation(
          implementation=impl, pallas=self.attention_pallas, cudnn_segment_bound=n)
    except attention_lib.AttentionInputError as e:
      raise ModelConfigError(
          f"DecoderConfig.attention_implementation={impl!r} (config attention.implementation), "
          f"attention_pallas, attention_cudnn_segment_bound: {e}") from e
    object.__setattr__(self, "attention_implementation", impl)  # resolved here, once
    if impl == "cudnn" and n is None:
      raise ModelConfigError(
          "DecoderConfig.attention_implementation='cudnn' needs attention_cudnn_segment_bound, "
          "the static bound on segments per row (cuDNN's backward memory grows with it; row "
          "length is no usable default): build the model with the data's bound, "
          "`train.model.decoder.build(..., segment_bound=Data.segment_bound)`")
    object.__setattr__(self, "dtype", compute_dtype(self.dtype))  # "auto" resolved here, once
    if not isinstance(self.rope_scaling, RopeScaling):
      raise ModelConfigError(
          f"DecoderConfig.rope_scaling must be a RopeScaling, got {self.rope_scaling!r}")
    for name, choices in (("dtype", sorted(DTYPES)), ("param_dtype", sorted(DTYPES)),
                          ("remat", list(REMATS))):
      if getattr(self, name) not in choices:
        raise ModelConfigError(
            f"DecoderConfig.{name} must be one of {choices}, got {getattr(self, name)!r}")


def attention_mesh(cfg: DecoderConfig) -> Any:
  """The mesh on which attention runs under `shard_map`: `cfg.attention_mesh` for the kernel
  backends (`segpack.attention.backend_mesh`) and, for every backend, when its `context` axis
  splits the sequence; else None (XLA on whole rows is left to the jit partitioner)."""
  if layout_lib.context_size(cfg.attention_mesh) > 1:
    return cfg.attention_mesh
  return attention_lib.backend_mesh(implementation=cfg.attention_implementation,
                                    mesh=cfg.attention_mesh)


def default_compute_dtype(platform: str | None = None) -> str:
  """`bfloat16` on GPU/TPU, `float32` on CPU."""
  platform = platform or jax.default_backend()
  return "float32" if platform == "cpu" else "bfloat16"


def compute_dtype(dtype: str) -> str:
  """The compute dtype `model.dtype` names: `dtype` itself, or for "auto" the platform's
  (`default_compute_dtype`)."""
  return default_compute_dtype() if dtype == "auto" else dtype


def pallas_options(attention_cfg: Any) -> attention_lib.PallasOptions | None:
  """The Pallas settings of the config's `attention` group: `attention.interpret=True` gives
  `PallasOptions(interpret=True)`, else None (the defaults, and nothing for other backends)."""
  return attention_lib.PallasOptions(interpret=True) if attention_cfg.interpret else None


def decoder_config(model_cfg: Any, attention_cfg: Any, *, vocab_size: int,
                   mesh: Any = None, cudnn_segment_bound: int | None = None) -> DecoderConfig:
  """The `DecoderConfig` of a trainer config's `model` and `attention` groups, for a
  vocabulary of `vocab_size`, kernel backends under `shard_map` on `mesh`, and cuDNN's static
  bound N on segments per row (`cudnn_segment_bound`; None for the other backends)."""
  return DecoderConfig(
      **dict(architecture_fields(model_cfg), vocab_size=vocab_size),
      attention_implementation=attention_cfg.implementation, attention_mesh=mesh,
      attention_pallas=pallas_options(attention_cfg),
      attention_cudnn_segment_bound=(None if cudnn_segment_bound is None
                                     else int(cudnn_segment_bound)))


def architecture_fields(model_cfg: Any) -> dict[str, Any]:
  """The config's `model` group as `Architecture` keyword arguments (`rope_scaling` and `lora`
  checked; ModelConfigError naming the `model.rope_scaling.*` / `model.lora.*` key otherwise)."""
  arch = {f.name: model_cfg[f.name] for f in dataclasses.fields(Architecture)}
  try:
    arch["rope_scaling"] = RopeScaling(**model_cfg.rope_scaling)
    arch["lora"] = Lora(**model_cfg.lora)
  except (RopeConfigError, LoraConfigError) as e:
    raise ModelConfigError(re.sub(r"\b(rope_scaling|lora)\.", r"model.\1.", str(e))) from e
  return arch


def cudnn_bound(config: Any, segment_bound: int | None) -> int | None:
  """The cuDNN backend's static N for `config`, from the data's most segments in a row.

  `round_segment_bound(segment_bound)` (a power of two) when `attention.implementation` is
  "cudnn", else None (the other backends need no bound). `packing.max_segments_per_row` stays the
  cap on the packing; the bound is what the packed data actually holds.

  Raises:
    ModelConfigError: cuDNN and no bound is known (`segment_bound` None).
  """
  if config.attention.implementation != "cudnn":
    return None
  if segment_bound is None:
    mode = config.packing.mode
    raise ModelConfigError(
        "attention.implementation='cudnn' needs a static bound on segments per row from the "
        f"data (Data.segment_bound), and none is known (packing.mode={mode!r}): with "
        "packing.mode='minibatch' and packing.tokens_per_batch a row can hold up to seq_len "
        "segments; set packing.examples_per_batch instead (the bound is then the examples per "
        "step) or use attention.implementation='pallas'")
  return attention_lib.round_segment_bound(int(segment_bound))

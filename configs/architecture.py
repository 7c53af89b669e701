"""The decoder's architecture, declared once: `Architecture` and its `RopeScaling`.

Their fields, defaults and comments are the trainer config's `model.*` keys: `configs/packed.py`
builds its `model` group from them (`declared_group`), `train.model.config.DecoderConfig` extends
`Architecture` with the attention backend, `train.hf.config` reads a Hugging Face config.json into
the fields a checkpoint sets (`checkpoint_keys`), and export writes them back. A key is added here,
with its comment, and read where it is used; nothing else lists it.

Plain Python (no JAX), so that a config file can import it cheaply.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from segpack.errors import UserError

# `RopeScaling.type`: the rotary frequency scalings a `Decoder` computes (Hugging Face's
# `rope_scaling.rope_type` values of the same names).
ROPE_SCALINGS = ("linear", "llama3")
# `Architecture.remat`: what each decoder layer keeps for the backward pass (`train.model`).
REMATS = ("none", "full", "dots")
# `Lora.targets`: the projections of a decoder layer an adapter can sit on (`train.adapters`).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# `Lora.base_dtype`: how the frozen base is stored under adapters: "param" (model.param_dtype), a
# float dtype, or quantized at import, one tensor at a time: "nf4" (QLoRA's 4-bit NormalFloat)
# and "int8" (blocks of 64 input rows, one float32 absmax scale per block and column).
LORA_BASE_DTYPES = ("param", "float32", "bfloat16", "float16", "nf4", "int8")


class RopeConfigError(UserError, ValueError):
  """A rotary scaling with an unknown type or inconsistent factors."""


def _setting(default: Any) -> Any:
  """A field that is a setting of the run, not a fact of a checkpoint (`checkpoint_keys` leaves it
  out: importing a model does not set it and export does not write it)."""
  return dataclasses.field(default=default, metadata={"checkpoint": False})


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """A rescaling of the rotary frequencies for contexts longer than pre-training's.

  `type="linear"`: every frequency divided by `factor` (positions interpolated). `type="llama3"`
  (Llama 3.1+): with `L = original_max_position_embeddings`, frequencies whose wavelength is
  below `L / high_freq_factor` stay, those above `L / low_freq_factor` are divided by `factor`,
  and the ones between are interpolated smoothly between the two (`train.model.rope.rope_inv_freq`).
  """

  type: str | None = None  # None (plain RoPE), "linear" or "llama3" (Llama 3.1's smooth scaling)
  factor: float = 1.0  # linear and llama3: the context extension factor
  low_freq_factor: float = 1.0  # llama3 only
  high_freq_factor: float = 4.0  # llama3 only
  # llama3 only: the pre-training context length the wavelengths are compared with
  original_max_position_embeddings: int | None = None

  def __post_init__(self):
    if self.type is None:
      return
    if self.type not in ROPE_SCALINGS:
      raise RopeConfigError(
          f"rope_scaling.type must be None or one of {ROPE_SCALINGS}, got {self.type!r}")
    if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not self.factor > 0:
      raise RopeConfigError(f"rope_scaling.factor must be > 0, got {self.factor!r}")
    if self.type != "llama3":
      return
    original = self.original_max_position_embeddings
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
      raise RopeConfigError(
          "rope_scaling.type='llama3' needs rope_scaling.original_max_position_embeddings, a "
          f"positive int, got {original!r}")
    if not self.high_freq_factor > self.low_freq_factor > 0:
      raise RopeConfigError(
          "rope_scaling.type='llama3' needs high_freq_factor > low_freq_factor > 0, got "
          f"{self.high_freq_factor!r} and {self.low_freq_factor!r}")


class LoraConfigError(UserError, ValueError):
  """LoRA settings that name an unknown projection or are inconsistent."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lora:
  """Low-rank adapters (LoRA, Hu et al. 2021; QLoRA with a quantized base, Dettmers et al. 2023).

  With `rank` > 0 every projection named in `targets` computes `x @ W + scale * x @ A @ B`
  with `scale = alpha / rank`; `W` (and every other weight of the model) is frozen, stored as
  `base_dtype` says, and only `A` `[in, rank]` and `B` `[rank, out]` are trained (B starts at 0,
  so step 0 is the base model). docs/adapters.md.
  """

  rank: int = 0  # r; 0: no adapters (every weight trains)
  alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  dropout: float = 0.0  # dropout on an adapter's input while training (PEFT's lora_dropout)
  # the projections that get adapters: "all" or a comma-separated list of q, k, v, o, gate, up,
  # down (PEFT's target_modules q_proj, ..., down_proj)
  targets: str = "all"
  # the frozen base's storage: "param" (model.param_dtype), "float32", "bfloat16", "float16",
  # "nf4" (4-bit NormalFloat, QLoRA) or "int8"; quantized kinds apply to the seven projections
  base_dtype: str = "param"

  def __post_init__(self):
    names = self.target_names
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown or not names or len(set(names)) != len(names):
      raise LoraConfigError(
          f"lora.targets must be 'all' or a comma-separated list of distinct names from "
          f"{list(LORA_TARGETS)}, got {self.targets!r}")

  @property
  def target_names(self) -> tuple[str, ...]:
    """The adapted projections, in `LORA_TARGETS` order ("all": every one)."""
    if not isinstance(self.targets, str):
      return ()
    if self.targets.strip() == "all":
      return LORA_TARGETS
    names = tuple(n.strip() for n in self.targets.split(",") if n.strip())
    return tuple(sorted(names, key=lambda n: (LORA_TARGETS + (n,)).index(n)))

  @property
  def scale(self) -> float:
    """`alpha / rank`, what multiplies the adapters' output (0 without adapters)."""
    return self.alpha / self.rank if self.rank else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Architecture:
  """A Llama-like decoder's hyper-parameters (`train.model.decoder.Decoder`), as the config keys them.

  With `model.init_from` the checkpoint's config.json sets every field but the run's settings
  (`init_std`, `dtype`, `param_dtype`; the last from its torch dtype unless given): docs/hf.md.
  """

  # The Hugging Face model_type this architecture is (export writes it): llama, mistral, qwen2,
  # qwen3; with model.init_from, the checkpoint's
  family: str = "llama"
  vocab_size: int | None = None  # V; None: the tokenizer's vocabulary size
  num_layers: int = 4  # L
  d_model: int = 256  # E
  num_heads: int = 4  # H
  num_kv_heads: int = 2  # K (grouped-query attention)
  head_dim: int = 64  # D
  d_ff: int = 704  # F (SwiGLU hidden size, ~8/3 E rounded to 64)
  rope_theta: float = 10_000.0  # RoPE base
  rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
  norm_eps: float = 1e-6  # RMSNorm epsilon
  tie_embeddings: bool = False  # share the input embedding and the output projection
  qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
  qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
  # Sliding-window attention of the checkpoint (tokens a query sees, itself included); None:
  # full attention. Rows longer than the window are refused (segpack attends to the whole row)
  sliding_window: int | None = None
  # Positions the model was built for (config.json's max_position_embeddings, written on
  # export); None: packing.seq_len
  max_position_embeddings: int | None = None
  init_std: float = _setting(0.02)  # std of the normal initialisers
  dtype: str = _setting("auto")  # compute dtype: "auto" = float32 on CPU, bfloat16 on GPU/TPU
  param_dtype: str = _setting("float32")  # parameter (and optimizer state) dtype
  # Rematerialisation of each decoder layer: "none" (keep every activation for the backward
  # pass), "full" (keep only the layer's input; recompute the rest in the backward pass) or
  # "dots" (keep the outputs of the matmuls without batch dimensions: the projections, not the
  # attention scores). Same losses and gradients, less memory for more compute
  remat: str = _setting("none")
  # Low-rank adapters: a run setting, never a fact of the base checkpoint (`Lora`)
  lora: Lora = dataclasses.field(default_factory=Lora, metadata={"checkpoint": False})


def checkpoint_keys() -> tuple[str, ...]:
  """The top-level `Architecture` fields a Hugging Face config.json sets, `rope_scaling` (a group
  of `RopeScaling` fields) aside."""
  return tuple(f.name for f in dataclasses.fields(Architecture)
               if f.metadata.get("checkpoint", True) and f.name != "rope_scaling")


def scaling_keys() -> tuple[str, ...]:
  """The `RopeScaling` fields (`model.rope_scaling.*` keys)."""
  return tuple(f.name for f in dataclasses.fields(RopeScaling))

"""The adapters wing's part of a run's state (`train.state`): what trains under adapters, where
the adapters start, and the checks of the `model.lora` and `model.init_adapter` keys.

With `model.lora.rank` > 0 the trainable filter is Flax's `nnx.LoRAParam`: the state's `params`
are the adapters (with their optimizer state), every other parameter is the frozen base
(`train.adapters.base`), never in a checkpoint, never in the optimizer. The adapters start
fresh (Flax's LoRA initialisers: A random, B = 0, so the first step starts from the base model
exactly) or from `model.init_adapter`, a PEFT adapter directory
(`train.adapters.peft_files`).

Example: rank 8 on q and v of a 2-layer model: the state's `params` holds 8 arrays
(`layers/{0,1}/attn/{q,v}/lora/lora_{a,b}`), the frozen part every weight of the model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from segpack.errors import UserError
from train.adapters import peft_files
from train.model import config as model_config
from train.model import decoder as model_lib
from train.model import lora as lora_lib
from train.model import quantize as quantize_lib
from train import sharding as sharding_lib
from configs.architecture import LORA_TARGETS

_GROUPS = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp",
           "down": "mlp"}


class AdapterConfigError(UserError, ValueError):
  """Adapters asked for where they cannot be trained, or an adapter that does not fit."""


def adapted(config: Any) -> bool:
  """Whether the run trains adapters (`model.lora.rank` > 0): the trainable filter is
  `nnx.LoRAParam`, else every `nnx.Param`."""
  return bool(config.model.lora.rank)


def check(config: Any) -> None:
  """Adapters train on a pretrained base: `model.lora.rank` > 0 needs `model.init_from`, and
  `model.init_adapter` needs adapters (one line naming the keys)."""
  m = config.model
  if m.lora.rank and m.init_from is None:
    raise AdapterConfigError(
        f"model.lora.rank={m.lora.rank} trains adapters on a pretrained base: set "
        "model.init_from=DIR (a Hugging Face model directory or a segpack export)")
  kind = lora_lib.quantized(model_config.architecture_fields(m)["lora"])
  for key, size in (("d_model", m.d_model), ("num_heads * head_dim", m.num_heads * m.head_dim),
                    ("d_ff", m.d_ff)):
    if kind and size % quantize_lib.BLOCK:
      raise AdapterConfigError(
          f"model.lora.base_dtype={kind!r} quantizes every projection in blocks of "
          f"{quantize_lib.BLOCK} input features, and model.{key}={size} (a projection's input) "
          f"is not a multiple of {quantize_lib.BLOCK}: choose model.lora.base_dtype='bfloat16'")
  if m.init_adapter is not None and not m.lora.rank:
    raise AdapterConfigError(
        f"model.init_adapter={m.init_adapter!r} continues LoRA adapters: set model.lora.rank "
        "(or let `python -m train.main` take it from the adapter's adapter_config.json)")


def adopt_adapter(config: Any, *, explicit: set[str] | frozenset[str] = frozenset()) -> None:
  """With `model.init_adapter` set, makes `model.lora`'s rank, alpha, targets and dropout the
  adapter's (`adapter_config.json`); a key given on the command line that contradicts it is an
  `AdapterConfigError` naming both values (`python -m train.main` calls this)."""
  directory = config.model.init_adapter
  if directory is None:
    return
  spec, _ = peft_files.read_adapter(directory=directory, num_layers=config.model.num_layers)
  theirs = dict(rank=spec.rank, alpha=float(spec.alpha), targets=",".join(spec.targets),
                dropout=float(spec.dropout))
  if spec.use_rslora:
    raise AdapterConfigError(f"model.init_adapter={directory!r}: use_rslora (scale alpha / "
                             "sqrt(r)) is not supported; segpack scales by alpha / r")
  for key, value in theirs.items():
    ours = config.model.lora[key]
    if f"model.lora.{key}" in explicit and ours != value and not (
        key == "targets" and ours == "all" and value == ",".join(LORA_TARGETS)):
      raise AdapterConfigError(f"model.lora.{key}={ours!r} differs from model.init_adapter="
                               f"{directory!r}'s {value!r} (leave it out to take the adapter's)")
    config.model.lora[key] = value


def adapter_path(layer: int, target: str, part: str) -> str:
  """The parameter path of one adapter matrix (`part` "a" or "b")."""
  return f"layers/{layer}/{_GROUPS[target]}/{target}/lora/lora_{part}"


def _imported(config: Any, abstract_params: Any, shardings: Any) -> Any:
  """The adapters of `model.init_adapter`, placed like `abstract_params` (their shapes checked)."""
  directory = config.model.init_adapter
  spec, tensors = peft_files.read_adapter(directory=directory,
                                          num_layers=config.model.num_layers)
  lora = config.model.lora
  if spec.use_rslora or (spec.rank, float(spec.alpha)) != (lora.rank, float(lora.alpha)):
    raise AdapterConfigError(
        f"model.init_adapter={directory!r} has r={spec.rank}, lora_alpha={spec.alpha}"
        f"{', use_rslora' if spec.use_rslora else ''}; model.lora has rank={lora.rank}, "
        f"alpha={lora.alpha} (train.adapters.trainable.adopt_adapter takes the adapter's)")
  flat = {}
  for (layer, target), (a_IxR, b_RxO) in tensors.items():
    flat[adapter_path(layer, target, "a")] = a_IxR
    flat[adapter_path(layer, target, "b")] = b_RxO
  wanted = sharding_lib.flat_params(abstract_params)
  if set(flat) != set(wanted):
    missing = sorted(set(wanted) ^ set(flat))[0]
    raise AdapterConfigError(
        f"model.init_adapter={directory!r}: its adapters (targets {list(spec.targets)}) differ "
        f"from model.lora's ({missing} is in one and not the other): set model.lora.targets="
        f"{','.join(spec.targets)!r} and model.lora.rank={spec.rank}")
  for path, x in wanted.items():
    if tuple(flat[path].shape) != tuple(x.shape):
      raise AdapterConfigError(
          f"model.init_adapter={directory!r}: {path} has shape {list(flat[path].shape)}, the "
          f"model's is {list(x.shape)} (model.lora.rank={config.model.lora.rank})")
  return jax.tree_util.tree_map_with_path(
      lambda p, x, s: jax.device_put(
          flat[sharding_lib.param_name(p)].astype(x.dtype), s),
      abstract_params, shardings)


def initial_adapters(config: Any, abstract_params: Any, shardings: Any, *, vocab_size: int,
                     mesh: Any, segment_bound: int | None) -> Any:
  """Step 3: fresh adapters (only their initialisers run: the rest of the build is dead code
  under `jit`), or `model.init_adapter`'s."""
  if config.model.init_adapter is not None:
    return _imported(config, abstract_params, shardings)

  def fresh():
    model = model_lib.build(config, config.train.seed, vocab_size=vocab_size, mesh=mesh,
                            segment_bound=segment_bound)
    return lora_lib.split(model, adapters=True)[1]

  return jax.jit(fresh, out_shardings=shardings)()


def adapters_off(params: Any) -> Any:
  """The adapters with every B at zero: the model they make is the base alone."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.zeros_like(x)
      if sharding_lib.param_name(p).endswith("lora_b") else x, params)

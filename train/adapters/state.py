"""A run's train state: what trains, what stays frozen, where each starts, and the jitted steps
that receive them.

Without adapters every parameter trains (`initial_state`: `model.init_from`'s weights or a
random initialisation). With them (`model.lora.rank` > 0, `train.train.setup`):
  1. `abstract_parts`: the model's shapes split into the trained adapters (`nnx.LoRAParam`: the
     train state's `params`, with their optimizer state) and the frozen rest (never in a
     checkpoint, never in the optimizer).
  2. `frozen_base`: the frozen parameters imported from `model.init_from` (quantized as
     `model.lora.base_dtype` says, `train.adapters.base`), and their fingerprint.
  3. `initial_adapters`: fresh adapters (Flax's LoRA initialisers: A random, B = 0, so the
     first step starts from the base model exactly), or those of `model.init_adapter`, a PEFT
     adapter directory (`train.adapters.peft_files`).
Each step receives the frozen part as an argument of its own, never donated and never updated.

Example: rank 8 on q and v of a 2-layer model: the state's `params` holds 8 arrays
(`layers/{0,1}/attn/{q,v}/lora/lora_{a,b}`), the frozen part every weight of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from segpack.errors import UserError
from train.adapters import base as base_lib
from train.adapters import lora as lora_lib
from train.adapters import peft_files
from train.adapters import quantize as quantize_lib
from train.hf import init_from as hf_init
from train import model as model_lib
from train import sharding as sharding_lib
from configs.architecture import LORA_TARGETS

_GROUPS = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp",
           "down": "mlp"}


class AdapterConfigError(UserError, ValueError):
  """Adapters asked for where they cannot be trained, or an adapter that does not fit."""


@dataclasses.dataclass(frozen=True)
class Frozen:
  """The frozen base on the mesh: its parameters, their shardings and their fingerprint."""

  params: Any
  shardings: Any
  fingerprint: str

  @property
  def num_params(self) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))

  @property
  def bytes(self) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(self.params))


def check(config: Any) -> None:
  """Adapters train on a pretrained base: `model.lora.rank` > 0 needs `model.init_from`, and
  `model.init_adapter` needs adapters (one line naming the keys)."""
  m = config.model
  if m.lora.rank and m.init_from is None:
    raise AdapterConfigError(
        f"model.lora.rank={m.lora.rank} trains adapters on a pretrained base: set "
        "model.init_from=DIR (a Hugging Face model directory or a segpack export)")
  kind = lora_lib.quantized(model_lib.architecture_fields(m)["lora"])
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


def abstract_parts(config: Any, *, vocab_size: int, mesh: Any,
                   segment_bound: int | None) -> tuple[Any, Any, Any]:
  """Step 1: `(graphdef, trained shapes, frozen shapes or None)`."""
  abstract = nnx.eval_shape(lambda: model_lib.build(
      config, config.train.seed, vocab_size=vocab_size, mesh=mesh, segment_bound=segment_bound))
  return lora_lib.split(abstract, adapters=bool(config.model.lora.rank))


def frozen_base(config: Any, abstract_frozen: Any, mesh: Any) -> Frozen:
  """Step 2: the frozen parameters of `model.init_from` on `mesh`, and their fingerprint."""
  shardings = sharding_lib.param_shardings(abstract_frozen, mesh)
  params = base_lib.load_base(model_dir=config.model.init_from, abstract_frozen=abstract_frozen,
                              shardings=shardings, model_cfg=config.model,
                              kind=lora_lib.quantized(model_lib.architecture_fields(
                                  config.model)["lora"]))
  return Frozen(params=params, shardings=shardings, fingerprint=base_lib.fingerprint(params))


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
        f"alpha={lora.alpha} (train.adapters.state.adopt_adapter takes the adapter's)")
  flat = {}
  for (layer, target), (a_IxR, b_RxO) in tensors.items():
    flat[adapter_path(layer, target, "a")] = a_IxR
    flat[adapter_path(layer, target, "b")] = b_RxO
  wanted = {}
  jax.tree_util.tree_map_with_path(
      lambda p, x: wanted.__setitem__(sharding_lib.path_str(p).removesuffix("/value"), x),
      abstract_params)
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
          flat[sharding_lib.path_str(p).removesuffix("/value")].astype(x.dtype), s),
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
      if sharding_lib.path_str(p).removesuffix("/value").endswith("lora_b") else x, params)


@contextlib.contextmanager
def threefry_kernel(*, enabled: bool) -> Iterator[None]:
  """While `enabled`, JAX's hand-written threefry kernel for the random draws of programs traced
  inside.

  XLA inlines and compiles a copy of the threefry hash for every random draw of a program: on
  one H200, compiling a Llama-3.2-1B-shaped initialisation took 62 of the setup's 65 s; with
  `jax_threefry_gpu_kernel_lowering` (one CUDA kernel instead) it took 5.5 of 7.9 s, and the
  draws of seven shapes were bit-identical both ways (docs/benchmarks.md). Other platforms are
  unaffected. The kernel is one custom call that XLA cannot split over devices, so it is used
  only where every device holds whole parameters anyway (`enabled`: the mesh's fsdp and tensor
  axes are 1).
  """
  before = jax.config.jax_threefry_gpu_kernel_lowering
  jax.config.update("jax_threefry_gpu_kernel_lowering", enabled)
  try:
    yield
  finally:
    jax.config.update("jax_threefry_gpu_kernel_lowering", before)


def initial_state(config: Any, workdir: str, abstract: Any, state_sh: Any,
                  tx: optax.GradientTransformation, *, vocab_size: int, mesh: Any,
                  segment_bound: int | None, adapters: bool) -> Any:
  """A fresh run's state: `model.init_from`'s weights (or, under adapters, fresh adapters or
  `model.init_adapter`'s), else a random initialisation, placed with `state_sh`."""
  whole = mesh.shape.get("fsdp", 1) * mesh.shape.get("tensor", 1) == 1
  with threefry_kernel(enabled=whole):
    return _initial_state(config, workdir, abstract, state_sh, tx, vocab_size=vocab_size,
                          mesh=mesh, segment_bound=segment_bound, adapters=adapters)


def _initial_state(config: Any, workdir: str, abstract: Any, state_sh: Any,
                   tx: optax.GradientTransformation, *, vocab_size: int, mesh: Any,
                   segment_bound: int | None, adapters: bool) -> Any:
  t = config.train
  if config.model.init_from is not None:
    hf_init.keep_source_files(config.model.init_from, workdir)
  if adapters:
    params = initial_adapters(config, abstract["params"], state_sh["params"],
                              vocab_size=vocab_size, mesh=mesh, segment_bound=segment_bound)
    return jax.jit(lambda p: dict(params=p, opt_state=tx.init(p), step=jnp.int32(0)),
                   out_shardings=state_sh)(params)
  if config.model.init_from is not None:
    return hf_init.initial_state(config, abstract["params"], state_sh, tx.init)

  def init():
    params = nnx.split(model_lib.build(config, t.seed, vocab_size=vocab_size, mesh=mesh,
                                       segment_bound=segment_bound))[1]
    return dict(params=params, opt_state=tx.init(params), step=jnp.int32(0))
  return jax.jit(init, out_shardings=state_sh)()


def jit_steps(train_step: Callable[..., Any], eval_step: Callable[..., Any], *, state_sh: Any,
              batch_sh: Any, replicated: Any, frozen: Frozen | None) -> tuple[Any, Any]:
  """The jitted steps, called as `(state, batch)` and `(params, batch)`; under adapters each
  receives the frozen base as a third argument, never donated."""
  more = () if frozen is None else (frozen.shardings,)
  train = jax.jit(train_step, in_shardings=(state_sh, batch_sh) + more,
                  out_shardings=(state_sh, replicated), donate_argnames=("state",))
  evaluate_ = jax.jit(eval_step, in_shardings=(state_sh["params"], batch_sh) + more,
                      out_shardings=replicated)
  if frozen is None:
    return train, evaluate_
  return (lambda state, batch: train(state, batch, frozen.params),
          lambda params, batch: evaluate_(params, batch, frozen.params))

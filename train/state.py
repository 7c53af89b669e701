"""One state for every run: what trains, what stays frozen, where each starts, and the jitted
steps that receive them.

Algorithm (`train.setup`):
  1. `abstract_state`: the decoder's shapes (`train.model.decoder.abstract`) split by the run's
     trainable filter (`train.adapters.trainable.adapted`: Flax's `nnx.LoRAParam` under
     adapters, else every parameter) into the trained part, the state's `params` with their
     optimizer state and step, and the frozen rest (None when everything trains).
  2. `frozen_base`: the frozen parameters, imported from `model.init_from` (quantized as
     `model.lora.base_dtype` says, `train.adapters.base`), and their fingerprint; `NO_BASE` when
     everything trains.
  3. `initial_state`: a fresh run's state: `model.init_from`'s weights, fresh adapters or
     `model.init_adapter`'s (`train.adapters.trainable`), else a random initialisation.
  4. `jit_steps`: the train and eval steps jitted with the state's shardings; each receives the
     frozen base as an argument of its own, never donated and never updated.

Example: full fine-tuning of a 2-layer model: the state's `params` is every weight, the frozen
base `NO_BASE`; rank 8 adapters on q and v: `params` holds 8 arrays, the base every weight.
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

from train.adapters import base as base_lib
from train.adapters import trainable
from train.hf import init_from as hf_init
from train.model import config as model_config
from train.model import decoder as model_lib
from train.model import lora as lora_lib
from train import sharding as sharding_lib


@dataclasses.dataclass(frozen=True)
class Frozen:
  """The frozen base on the mesh: its parameters, their shardings and their fingerprint (all
  None in `NO_BASE`, the base of a run where every parameter trains)."""

  params: Any
  shardings: Any
  fingerprint: str | None

  @property
  def num_params(self) -> int:
    return count(self.params)

  @property
  def bytes(self) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(self.params))


NO_BASE = Frozen(params=None, shardings=None, fingerprint=None)


def count(tree: Any) -> int:
  """The elements of a pytree of arrays or shapes (a model's parameters)."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def abstract_parts(config: Any, *, vocab_size: int, mesh: Any,
                   segment_bound: int | None) -> tuple[Any, Any, Any]:
  """`(graphdef, trained shapes, frozen shapes or None)`."""
  abstract = model_lib.abstract(config, vocab_size=vocab_size, mesh=mesh,
                                segment_bound=segment_bound)
  return lora_lib.split(abstract, adapters=trainable.adapted(config))


def abstract_state(config: Any, tx: optax.GradientTransformation, *, vocab_size: int,
                   mesh: Any, segment_bound: int | None = None) -> tuple[Any, Any, Any]:
  """Step 1: `(graphdef, the state's shapes, the frozen shapes or None)`."""
  graphdef, params, frozen = abstract_parts(config, vocab_size=vocab_size, mesh=mesh,
                                            segment_bound=segment_bound)
  state = dict(params=params, opt_state=jax.eval_shape(tx.init, params),
               step=jax.ShapeDtypeStruct((), jnp.int32))
  return graphdef, state, frozen


def frozen_base(config: Any, abstract_frozen: Any, mesh: Any) -> Frozen:
  """Step 2: the frozen parameters of `model.init_from` on `mesh`, and their fingerprint
  (`NO_BASE` for `abstract_frozen` None)."""
  if abstract_frozen is None:
    return NO_BASE
  shardings = sharding_lib.param_shardings(abstract_frozen, mesh)
  params = base_lib.load_base(model_dir=config.model.init_from, abstract_frozen=abstract_frozen,
                              shardings=shardings, model_cfg=config.model,
                              kind=lora_lib.quantized(model_config.architecture_fields(
                                  config.model)["lora"]))
  return Frozen(params=params, shardings=shardings, fingerprint=base_lib.fingerprint(params))


def base_params(params: Any, frozen: Frozen) -> Any:
  """The parameters of the model a run starts from, as the steps and the scoring pass take
  them: `params` itself, or under adapters `(adapters with every B at zero, the base)`."""
  if frozen.params is None:
    return params
  return trainable.adapters_off(params), frozen.params


def current_params(params: Any, frozen: Frozen) -> Any:
  """The parameters of the model as it trains now: `params`, or `(params, the base)`."""
  return params if frozen.params is None else (params, frozen.params)


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
    params = trainable.initial_adapters(config, abstract["params"], state_sh["params"],
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
              batch_sh: Any, replicated: Any, frozen: Frozen) -> tuple[Any, Any]:
  """Step 4: the jitted steps, called as `(state, batch)` and `(params, batch)`; under adapters
  each receives the frozen base as a third argument, never donated (`NO_BASE`: the jitted
  steps themselves, `.trace` and `.lower` included)."""
  more = () if frozen.params is None else (frozen.shardings,)
  train = jax.jit(train_step, in_shardings=(state_sh, batch_sh) + more,
                  out_shardings=(state_sh, replicated), donate_argnames=("state",))
  evaluate_ = jax.jit(eval_step, in_shardings=(state_sh["params"], batch_sh) + more,
                      out_shardings=replicated)
  if frozen.params is None:
    return train, evaluate_
  return (lambda state, batch: train(state, batch, frozen.params),
          lambda params, batch: evaluate_(params, batch, frozen.params))

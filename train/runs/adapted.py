"""A run that trained adapters, read back: its adapters from the checkpoint, its frozen base from
`model.init_from`, and the two together (the model it trained, or the weights merged).

A checkpoint of such a run (`model.lora.rank` > 0) holds the adapters only
(`train.state`); the base is read again from the directory the run started from, so
that directory must still be there (its path is the saved `model.init_from`), and its
fingerprint must be the one the checkpoint recorded (`train.adapters.base.fingerprint`).

Example: `restore_adapters` of a rank-8 run on q and v of 2 layers returns the 8 arrays
`layers/{0,1}/attn/{q,v}/lora/lora_{a,b}`; `merged_params` returns every weight of the model
with `W + alpha / rank * A @ B` in place of each adapted kernel `W`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from train.model import lora as lora_lib
from train.hf import weights as hf_weights
from train.model import config as model_config
from train.model import decoder as model_lib
from train.runs import saved as saved_run
from train.runs.errors import RunError
from train import sharding as sharding_lib
from train import state as state_lib


def is_adapted(config: Any) -> bool:
  """Whether the run trained adapters (its saved `model.lora.rank` > 0)."""
  return bool(config.model.lora.rank)


def _check_base(config: Any, checkpoint: Any) -> None:
  init_from = config.model.init_from
  if init_from is None or not os.path.isdir(init_from):
    raise RunError(
        f"{checkpoint.directory}/{checkpoint.step}: the run trained adapters on the base "
        f"model.init_from={init_from!r}, which is not a directory here; the adapters alone are "
        "kept in the run (train.export --adapter writes them without the base)")


def restore_adapters(checkpoint: Any, config: Any, mesh: Any) -> tuple[Any, Any, Any]:
  """`(graphdef, adapters, frozen shapes)`: the checkpoint's adapters placed on `mesh` (split as
  the trainer splits parameters), and the model's graph to merge them with a base."""
  abstract = model_lib.abstract(saved_run.sampling_config(config),
                              vocab_size=config.model.vocab_size)
  graphdef, abstract_trained, abstract_frozen = lora_lib.split(abstract, adapters=True)
  adapters = saved_run.restore_params(checkpoint, abstract_trained,
                                     sharding_lib.param_shardings(abstract_trained, mesh))
  return graphdef, adapters, abstract_frozen


def load_model(checkpoint: Any, config: Any) -> Any:
  """The model the run trained, on the first device: its base (quantized as it trained) with
  the checkpoint's adapters."""
  _check_base(config, checkpoint)
  mesh = sharding_lib.make_mesh(data=1, devices=jax.devices()[:1])
  graphdef, adapters, abstract_frozen = restore_adapters(checkpoint, config, mesh)
  frozen = state_lib.frozen_base(config, abstract_frozen, mesh)
  _check_fingerprint(checkpoint, config, frozen.fingerprint)
  return lora_lib.merge(graphdef, adapters, frozen.params)


def _check_fingerprint(checkpoint: Any, config: Any, found: str) -> None:
  """Refuses a base at `model.init_from` that is not the one the adapters trained on (the
  checkpoint's recorded fingerprint of the frozen base, as resuming checks it)."""
  meta = saved_run.restore_item(checkpoint, "restore",
                                args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  recorded = meta.get("base")
  if recorded is not None and recorded != found:
    raise RunError(
        f"{checkpoint.directory}/{checkpoint.step}: the run's adapters were trained on the base "
        f"{recorded}, and model.init_from={config.model.init_from!r} now holds {found}: another "
        f"model; put the base the run trained on back there (train.export --adapter writes the "
        f"adapters alone)")


def flat_adapters(adapters: Any) -> dict[str, jax.Array]:
  """`{parameter path: array}` of an adapter tree (`layers/0/attn/q/lora/lora_a`)."""
  return sharding_lib.flat_params(adapters)


def _merge_one(kernel_IxO: jax.Array, a_IxR: jax.Array, b_RxO: jax.Array,
               scale: float) -> jax.Array:
  """`W + scale * A @ B` in float32, stored as `W` is (its dtype and sharding)."""
  sharding = kernel_IxO.sharding

  def merge(w, a, b):
    delta = jax.sharding.reshard(scale * (a.astype(jnp.float32) @ b.astype(jnp.float32)),
                                 sharding)
    return (w.astype(jnp.float32) + delta).astype(w.dtype)
  return jax.jit(merge, out_shardings=kernel_IxO.sharding)(kernel_IxO, a_IxR, b_RxO)


def merged_params(checkpoint: Any, config: Any, mesh: Any) -> dict[str, jax.Array]:
  """Every weight of the model with the adapters merged, split over `mesh` (`{path: array}`):
  the base read from `model.init_from` in its own precision (never the quantized copy the run
  trained on), each adapted kernel `W + alpha / rank * A @ B`."""
  _check_base(config, checkpoint)
  _, adapters, _ = restore_adapters(checkpoint, config, mesh)
  adapters = flat_adapters(adapters)
  plain = saved_run.sampling_config(config)
  plain.model.lora.rank = 0
  abstract = nnx.split(model_lib.abstract(plain, vocab_size=config.model.vocab_size))[1]
  base = hf_weights.load_params(config.model.init_from, abstract,
                                sharding_lib.param_shardings(abstract, mesh), config.model)
  flat = flat_adapters(base)
  scale = model_config.architecture_fields(config.model)["lora"].scale
  for path in sorted(p for p in adapters if p.endswith("/lora/lora_a")):
    kernel = path.removesuffix("/lora/lora_a") + "/kernel"
    flat[kernel] = _merge_one(flat[kernel], adapters[path],
                              adapters[path.removesuffix("_a") + "_b"], scale)
  return flat

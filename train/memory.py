"""The peak memory of one training step per device, estimated before anything is compiled.

`estimate(...)` adds up the arrays a step of `train.steps.make_train_step` holds at its peak
(`MemoryEstimate`), `from_config(config, ...)` reads its settings from a trainer config,
`device_memory()` tells how much the device has, and `check_fits` refuses a step that will not
fit in one line naming the config keys that shrink its largest parts.

Measured and approximated: the constants below (`LOGITS_ARRAYS`, `BLOCK_ARRAYS`,
`SCORE_ARRAYS`, `UPDATE_ARRAYS`, the floats per token of `layer_floats`) were fitted to the peak
of the step on one CPU device (peak RSS of a fresh process, `python -m train.bench.memory`,
docs/benchmarks.md; and XLA's `compiled.memory_analysis()`, which agrees with it within a few
percent) for a 2-layer, E = 64 decoder with V = 151,643 and 303,286 on rows of 1,024 to 8,192
slots: the estimate is within 25% of every measured case. What is exact: the parameters, their
gradients and the optimizer's moments (counts times bytes). What is approximate: the
activations a layer saves (XLA fuses and reuses buffers, so the count of `[B, S, E]`-like arrays
per token is a fit, and the peak is the sum of the parts while the real parts partly follow one
another: the head's logits are freed before the layers' backward pass runs); the rematerialised
policies ("full", "dots"), which are modelled as a GPU applies them and could not be measured
here: XLA on the CPU merges the recomputation back before it compiles (`applied_remat`); bf16
activations (`compute_bytes=2`), whose attention scores stay float32 here; context and tensor
parallelism and ZeRO-3 (`mesh.context`, `mesh.tensor`, `mesh.fsdp`), which are not modelled
(parameters and optimizer state are counted whole on every device); the runtime's own memory
(compiled code, the CUDA context), which is not counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from configs.architecture import REMATS
from segpack.errors import ArgumentError
from train.model import config as model_config
from train import sharding as sharding_lib

GIB = 2**30
# The full-logits loss: the float32 `[B, S, V]` logits kept for the backward pass and their
# gradient (softmax minus one-hot), alive together at the start of the backward pass.
LOGITS_ARRAYS = 2
# The blocked loss (`loss.block_size > 0`): one `[block, chunk]` float32 array of logits, which
# XLA's fusion turns into its gradient in place.
BLOCK_ARRAYS = 1
# Dense (XLA) attention: float32 `[B, H, S, S]` arrays each layer keeps for the backward pass
# (the masked scores, the softmax, the probabilities zeroed on padding).
SCORE_ARRAYS = 3
# The optimizer's update, formed whole before it is added to the parameters.
UPDATE_ARRAYS = 1
# Backends whose attention holds the `[S, S]` scores (the flash kernels keep `[B, H, S]`).
DENSE_ATTENTION = ("xla",)
FLOAT32 = 4
# The config keys that shrink each part, for `check_fits`'s message.
SHRINK_KEYS = {
    "logits": "loss.block_size, train.batch_size, packing.seq_len",
    "blocked logits": "loss.block_size, loss.vocab_block_size",
    "activations": "model.remat, train.batch_size (or more train.grad_accum_steps), "
                   "packing.seq_len",
    "parameters": "a smaller model, mesh.fsdp",
    "gradients": "a smaller model, mesh.fsdp",
    "optimizer": "a smaller model, mesh.fsdp",
}
# Under adapters the trained parameters are the adapters: their size is model.lora.rank's.
ADAPTER_SHRINK_KEYS = {
    "parameters": "model.lora.rank, model.lora.base_dtype (an nf4 or int8 base), mesh.fsdp",
    "gradients": "model.lora.rank, model.lora.targets, mesh.fsdp",
    "optimizer": "model.lora.rank, model.lora.targets, mesh.fsdp",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
  """The bytes one training step holds per device at its peak, by part.

  Algorithm (`estimate`):
    1. parameters: `num_params * param_bytes`; gradients: as many (the parameters' dtype).
    2. optimizer: `(optimizer_states + UPDATE_ARRAYS) * num_params * param_bytes`: AdamW's two
       moments and the update formed before it is applied.
    3. activations, for one layer on `B * S` tokens (`B` rows of `S` slots per micro-batch):
       `layer_floats` values per token in the compute dtype, plus with dense (XLA) attention
       `SCORE_ARRAYS` float32 `[B, H, S, S]` arrays (flash kernels: one `[B, H, S]`). Then by
       `remat`: "none" keeps every layer's (`L * layer`); "full" keeps each layer's input
       `[B, S, E]` and recomputes one layer at a time (`L * B*S*E + layer`); "dots" also keeps
       the projections' outputs (`L * B*S*dot_floats + layer`).
    4. logits: the full-logits loss holds `LOGITS_ARRAYS` float32 `[B*S, V]` arrays; the
       blocked loss `BLOCK_ARRAYS` `[block, chunk]` ones (`block = min(loss_block, B*S)`,
       `chunk` the vocabulary or `loss_vocab_block`), whatever `S` and `V` are.
    5. total: the sum of the parts.

  Example: 40,000 float32 parameters, one layer (E = 16, F = 32, H = K = 1, D = 16), 2 rows of 8
  slots, V = 1,000, XLA attention, no remat: parameters 160,000 B, gradients 160,000, optimizer
  3 * 160,000 = 480,000; a layer keeps 4*16 + 2*3*16 + 16 + 4*32 = 304 floats per token,
  16 * 304 * 4 = 19,456 B, and 3 * 2 * 1 * 8 * 8 * 4 = 1,536 B of scores, 20,992 in all; the
  logits 2 * 16 * 1,000 * 4 = 128,000 B (blocks of 4: 1 * 4 * 1,000 * 4 = 16,000); total
  948,992 B.
  """

  parameters: int
  gradients: int
  optimizer: int
  activations: int
  logits: int
  blocked: bool = False  # the logits part is the blocked loss's (for `check_fits`'s keys)
  adapters: bool = False  # the trained parameters are adapters over a frozen base (the same)

  @property
  def total(self) -> int:
    """The sum of the parts, in bytes."""
    return sum(self.parts().values())

  def parts(self) -> dict[str, int]:
    """The parts by name, in bytes, in the order of the algorithm."""
    return dict(parameters=self.parameters, gradients=self.gradients, optimizer=self.optimizer,
                activations=self.activations, logits=self.logits)

  def table(self) -> str:
    """One line per part and the total, in GiB."""
    rows = [*self.parts().items(), ("total", self.total)]
    return "\n".join(f"{name:<12} {size / GIB:>9.3f} GiB" for name, size in rows)

  def line(self, available: int | None = None) -> str:
    """One log line: the total and every part, in GiB, and the `available` memory beside it."""
    parts = ", ".join(f"{name} {size / GIB:.2f}" for name, size in self.parts().items())
    beside = "" if available is None else f" of {available / GIB:.2f} GiB available"
    return (f"memory per device (estimate): {self.total / GIB:.2f} GiB{beside} ({parts} "
            f"GiB)")


def layer_floats(*, d_model: int, d_ff: int, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> int:
  """Values per token a decoder layer keeps for its backward pass (no remat), scores aside.

  `4 * E` (the layer's input, its two normalised inputs, the residual sum), `2 * (H + 2K) * D`
  (q, k, v before and after RoPE), `H * D` (the attention's output) and `4 * F` (gate, up,
  silu(gate) and their product): a fit to XLA's CPU buffers (`MemoryEstimate`).
  """
  qkv = (num_heads + 2 * num_kv_heads) * head_dim
  return 4 * d_model + 2 * qkv + num_heads * head_dim + 4 * d_ff


def dot_floats(*, d_model: int, d_ff: int, num_heads: int, num_kv_heads: int,
               head_dim: int) -> int:
  """Values per token that `remat="dots"` keeps for a layer: its input and the outputs of the
  matmuls without batch dimensions (q, k, v; the o and down projections; gate and up)."""
  return d_model + (num_heads + 2 * num_kv_heads) * head_dim + 2 * d_model + 2 * d_ff


def _check_counts(**counts: int) -> None:
  for name, value in counts.items():
    low = 0 if name in ("loss_block", "loss_vocab_block", "optimizer_states") else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ArgumentError(f"estimate: {name} must be an int >= {low}, got {value!r}")


def estimate(*, num_params: int, vocab_size: int, d_model: int, d_ff: int, num_layers: int,
             num_heads: int, num_kv_heads: int, head_dim: int, batch_rows: int, seq_len: int,
             param_bytes: int = 4, compute_bytes: int = 4, loss_block: int,
             loss_vocab_block: int = 0, remat: str, attention: str = "xla",
             optimizer_states: int = 2, frozen_bytes: int = 0) -> MemoryEstimate:
  """The peak memory of one training step per device (`MemoryEstimate`'s algorithm).

  Args:
    num_params: the model's parameters.
    vocab_size: V.
    d_model, d_ff, num_layers, num_heads, num_kv_heads, head_dim: E, F, L, H, K, D.
    batch_rows: rows per micro-batch on this device (`train.batch_size / grad_accum_steps /
      data-parallel devices`).
    seq_len: slots per row.
    param_bytes: bytes per parameter (and gradient, and optimizer state value).
    compute_bytes: bytes per activation value (the compute dtype).
    loss_block: `loss.block_size`: positions per block of the blocked loss; 0: the full logits.
    loss_vocab_block: `loss.vocab_block_size`: vocabulary columns per chunk; 0: all of V.
    remat: `model.remat`, the policy the compiled step applies (`applied_remat`).
    attention: the attention backend (`attention.implementation`, resolved): "xla" holds the
      `[S, S]` scores, the others (flash kernels) do not.
    optimizer_states: arrays of the parameters' shape the optimizer keeps (AdamW: 2).
    frozen_bytes: weights that neither train nor have optimizer state (the base under adapters;
      `num_params` then counts the adapters), counted with the parameters.

  Raises:
    ArgumentError: a count that is not a positive int (0 allowed for the loss's blocks and the
      optimizer states), or `remat` not one of `configs.architecture.REMATS`.
  """
  _check_counts(num_params=num_params, vocab_size=vocab_size, d_model=d_model, d_ff=d_ff,
                num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, batch_rows=batch_rows, seq_len=seq_len,
                param_bytes=param_bytes, compute_bytes=compute_bytes, loss_block=loss_block,
                loss_vocab_block=loss_vocab_block, optimizer_states=optimizer_states)
  if remat not in REMATS:
    raise ArgumentError(f"estimate: remat must be one of {list(REMATS)}, got {remat!r}")
  shape = dict(d_model=d_model, d_ff=d_ff, num_heads=num_heads, num_kv_heads=num_kv_heads,
               head_dim=head_dim)
  tokens = batch_rows * seq_len
  if attention in DENSE_ATTENTION:
    scores = SCORE_ARRAYS * batch_rows * num_heads * seq_len * seq_len * FLOAT32
  else:
    scores = batch_rows * num_heads * seq_len * FLOAT32
  layer = tokens * layer_floats(**shape) * compute_bytes + scores
  if remat == "none":
    activations = num_layers * layer
  else:
    kept = d_model if remat == "full" else dot_floats(**shape)
    activations = num_layers * tokens * kept * compute_bytes + layer
  if loss_block == 0:
    logits = LOGITS_ARRAYS * tokens * vocab_size * FLOAT32
  else:
    chunk = min(loss_vocab_block or vocab_size, vocab_size)
    logits = BLOCK_ARRAYS * min(loss_block, tokens) * chunk * FLOAT32
  weights = num_params * param_bytes
  return MemoryEstimate(parameters=weights + frozen_bytes, gradients=weights,
                        optimizer=(optimizer_states + UPDATE_ARRAYS) * weights,
                        activations=activations, logits=logits, blocked=loss_block > 0,
                        adapters=frozen_bytes > 0)


def applied_remat(remat: str, *, platform: str) -> str:
  """The policy a compiled step applies: `remat`, but "none" on the CPU, where XLA merges the
  recomputation back before it compiles (docs/training.md, "Long rows and large
  vocabularies"), so the step holds what it holds without remat."""
  return "none" if platform == "cpu" else remat


def _itemsize(dtype: str) -> int:
  return jnp.dtype(model_config.DTYPES[dtype]).itemsize


def from_config(config: Any, *, num_params: int, vocab_size: int, devices: int = 1,
                platform: str | None = None, frozen_bytes: int = 0) -> MemoryEstimate:
  """The estimate of a trainer config's step (`configs/packed.py` keys).

  Rows per micro-batch on a device: `train.batch_size / train.grad_accum_steps / devices`,
  rounded up; `loss.block_size`, `loss.vocab_block_size` (0 where absent) and `model.remat`
  ("none" where absent, and as `applied_remat` on `platform`); the parameter and compute bytes
  from `model.param_dtype` and `model.dtype` ("auto": the platform's); the attention backend
  from `attention.implementation` (None: "xla" on the CPU, a flash kernel elsewhere).

  Args:
    config: a trainer config.
    num_params: the model's trained parameters.
    vocab_size: V (the model's: `model.vocab_size` or the data's).
    devices: the devices the rows are split over (`train.sharding.batch_partitions`).
    platform: "cpu", "gpu", "tpu"; None: JAX's default backend.
    frozen_bytes: the frozen base's bytes under adapters (`estimate`).
  """
  platform = platform or jax.default_backend()
  m = config.model
  rows = -(-int(config.train.batch_size) // (int(config.train.grad_accum_steps) * devices))
  dtype = m.dtype
  compute = model_config.default_compute_dtype(platform) if dtype == "auto" else dtype
  implementation = config.attention.implementation
  attention = implementation or ("xla" if platform == "cpu" else "pallas")
  return estimate(
      num_params=num_params, vocab_size=vocab_size, d_model=m.d_model, d_ff=m.d_ff,
      num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
      head_dim=m.head_dim, batch_rows=max(1, rows), seq_len=int(config.packing.seq_len),
      param_bytes=_itemsize(m.param_dtype),
      compute_bytes=_itemsize(compute),
      loss_block=int(config.loss.block_size),
      loss_vocab_block=int(config.loss.vocab_block_size),
      remat=applied_remat(m.remat, platform=platform),
      attention=attention, frozen_bytes=frozen_bytes)


def host_memory() -> int | None:
  """The machine's available memory in bytes (`MemAvailable` of /proc/meminfo), None where it
  cannot be read."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    return None
  return None


def device_memory(*, device: Any = None) -> int | None:
  """The memory a step may use on `device` (default: the first), in bytes.

  On a GPU or TPU its allocator's `bytes_limit` (`memory_stats()`), on the CPU the machine's
  available memory (`host_memory`); None where neither is known.
  """
  device = jax.devices()[0] if device is None else device
  if device.platform == "cpu":
    return host_memory()
  stats = device.memory_stats() or {}
  limit = stats.get("bytes_limit")
  return int(limit) if limit else None


def check_fits(estimate: MemoryEstimate, available: int | None, *, what: str) -> None:
  """Refuses a step whose estimate exceeds `available` bytes (None: nothing known, no check).

  Raises:
    ArgumentError: one line: `what`, the estimate and the memory available, and the two largest
      parts with the config keys that shrink them.
  """
  if available is None or estimate.total <= available:
    return
  largest = sorted(estimate.parts().items(), key=lambda item: -item[1])[:2]
  named = []
  for name, size in largest:
    keys = SHRINK_KEYS["blocked logits" if name == "logits" and estimate.blocked else name]
    keys = ADAPTER_SHRINK_KEYS.get(name, keys) if estimate.adapters else keys
    named.append(f"{name} {size / GIB:.2f} GiB ({keys})")
  raise ArgumentError(
      f"{what}: one training step needs about {estimate.total / GIB:.2f} GiB per device, more "
      f"than the {available / GIB:.2f} GiB available; its largest parts: {'; '.join(named)}")


def check_run(config: Any, num_params: int, vocab_size: int, mesh: Any, *,
              frozen_bytes: int = 0) -> MemoryEstimate:
  """The estimate of a run's step on `mesh` (`from_config`, the rows split over its batch
  partitions), refused by `check_fits` against `device_memory()` before anything compiles."""
  found = from_config(config, num_params=num_params, vocab_size=vocab_size,
                      devices=sharding_lib.batch_partitions(mesh), frozen_bytes=frozen_bytes)
  check_fits(found, device_memory(), what="the training step (estimated per device)")
  return found

"""Segment-masked attention over packed rows, one module per backend.

`segment_attention` (`dispatch.py`) validates its inputs, then dispatches on `implementation`:

- `"xla"` (`xla.py`): a dense `[S, S]` mask; runs everywhere; the oracle for the others.
- `"pallas"` (`pallas.py`): a flash-attention kernel (forward and backward in Pallas) that visits
  only the key/value blocks holding the query block's segments; Triton on a GPU, interpret mode
  on the CPU; its settings come grouped, `pallas=PallasOptions(...)`.
- `"cudnn"` (`cudnn.py`): JAX's cuDNN fused attention with its packed (offsets/seqlens) layout;
  it needs `cudnn_segment_bound=`, e.g. `round_segment_bound(dataset.segment_bound)`.
- `None`: Pallas on a GPU (cuDNN, with one warning, on a JAX without Pallas's Triton backend),
  XLA elsewhere.

A setting for another backend is refused. `resolve_implementation` and `backend_mesh` hold the
rules about backends (which one runs, what it accepts, where it runs, whether it takes a mesh).

With a `mesh` it runs per device under `shard_map` (`sharded.py`; axis names from `segpack.mesh`);
with a `context_axis` too, the sequence is split over it and each device all-gathers the row's
keys and values (`context_parallel.py`, context parallelism; `slot_index` places reordered
slots, and `context_comm_bytes` counts the bytes moved).
`self_check` (`leak_check.py`) runs a backend against per-document XLA runs, forward and backward.
"""

from __future__ import annotations

from segpack.attention.checks import (
    AttentionInputError,
    AttentionTypeError,
    NonContiguousSegmentsError,
)
from segpack.attention.context_parallel import context_comm_bytes
from segpack.attention.cudnn import round_segment_bound
from segpack.attention.dispatch import (
    IMPLEMENTATIONS,
    Implementation,
    backend_mesh,
    default_implementation,
    resolve_implementation,
    segment_attention,
)
from segpack.attention.leak_check import AttentionLeakError, SelfCheckResult, self_check
from segpack.attention.pallas import PallasOptions

__all__ = [
    "AttentionInputError",
    "AttentionLeakError",
    "AttentionTypeError",
    "NonContiguousSegmentsError",
    "PallasOptions",
    "SelfCheckResult",
    "IMPLEMENTATIONS",
    "Implementation",
    "backend_mesh",
    "context_comm_bytes",
    "default_implementation",
    "resolve_implementation",
    "round_segment_bound",
    "segment_attention",
    "self_check",
]

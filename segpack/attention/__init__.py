"""Segment-masked attention over packed rows, one module per backend.

`segment_attention` (`dispatch.py`) validates its inputs, then dispatches on `implementation`:

- `"xla"` (`xla.py`): a dense `[S, S]` mask; runs everywhere; the oracle for the others.
- `"pallas"` (`pallas.py`): a flash-attention kernel (forward and backward in Pallas) that visits
  only the key/value blocks holding the query block's segments; Triton on a GPU, `interpret=True`
  on the CPU.
- `"cudnn"` (`cudnn.py`): JAX's cuDNN fused attention with its packed (offsets/seqlens) layout.
- `None`: Pallas on a GPU, XLA elsewhere.

With a `mesh` it runs per device under `shard_map` (`sharded.py`; axis names from `segpack.mesh`).
`self_check` (`leak_check.py`) runs a backend against per-document XLA runs, forward and backward.
"""

from __future__ import annotations

from segpack.attention.checks import (
    AttentionInputError,
    AttentionTypeError,
    NonContiguousSegmentsError,
)
from segpack.attention.dispatch import (
    IMPLEMENTATIONS,
    Implementation,
    default_implementation,
    segment_attention,
)
from segpack.attention.leak_check import AttentionLeakError, SelfCheckResult, self_check

__all__ = [
    "AttentionInputError",
    "AttentionLeakError",
    "AttentionTypeError",
    "NonContiguousSegmentsError",
    "SelfCheckResult",
    "IMPLEMENTATIONS",
    "Implementation",
    "default_implementation",
    "segment_attention",
    "self_check",
]

"""segpack: packed, segment-annotated training batches and segment-masked attention for JAX.

The public names are imported lazily, so `import segpack` stays cheap and free of side effects.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ShardSource": "segpack.shards",
    "ShardWriter": "segpack.shards",
    "ShardFormatError": "segpack.shards",
    "pack_dataset": "segpack.data.packed",
    "pack_minibatches": "segpack.data.minibatch_dataset",
    "PackedDataset": "segpack.data.packed",
    "StreamBatches": "segpack.data.stream",
    "StreamPosition": "segpack.data.position",
    "BalanceOptions": "segpack.data.balance",
    "Mixture": "segpack.data.mixture",
    "MixtureSource": "segpack.data.mixture",
    "MinibatchPackedDataset": "segpack.data.minibatch_dataset",
    "SpecialTokens": "segpack.data.options",
    "LongDocs": "segpack.packing",
    "PlanOptions": "segpack.packing",
    "PipelineConfigError": "segpack.data.options",
    "plan": "segpack.packing",
    "Plan": "segpack.packing",
    "cu_seqlens": "segpack.interop",
    "position_ids": "segpack.interop",
    "segment_attention": "segpack.attention",
    "cross_entropy_loss": "segpack.loss",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'segpack' has no attribute {name!r}")
  return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
  return sorted(list(globals()) + __all__)

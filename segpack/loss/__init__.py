"""The losses of packed rows: cross-entropy over a global count, blocked, and preference losses.

- `tokens.py`: every token's cross-entropy from the logits (`token_cross_entropy`), its
  weightings (`token_loss_sum`, `token_loss_by_source`), the global counts that normalise it
  (`count_trained_tokens`, `loss_normalizer`, ...) and the one-call `cross_entropy_loss`.
- `blocks.py`: the same token losses from the final hidden states and the output projection,
  a block of positions at a time (`blocked_token_losses`); the weightings read them as they are.
- `preference.py`: preference losses on packed pairs (DPO, IPO, SimPO, ORPO); import it as
  `segpack.loss.preference`.
- `labels.py`: `IGNORE_INDEX`, the label that carries no loss.

The names below are imported lazily (`from segpack import loss; loss.token_loss_sum(...)`), so
`IGNORE_INDEX` is read without importing JAX.
"""

import importlib
from typing import Any

_EXPORTS = {
    "IGNORE_INDEX": "segpack.loss.labels",
    "WEIGHTINGS": "segpack.loss.tokens",
    "check_weighting": "segpack.loss.tokens",
    "count_trained_documents": "segpack.loss.tokens",
    "count_trained_tokens": "segpack.loss.tokens",
    "cross_entropy_loss": "segpack.loss.tokens",
    "document_token_counts": "segpack.loss.tokens",
    "loss_normalizer": "segpack.loss.tokens",
    "token_cross_entropy": "segpack.loss.tokens",
    "token_loss_by_source": "segpack.loss.tokens",
    "token_loss_sum": "segpack.loss.tokens",
    "blocked_token_losses": "segpack.loss.blocks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'segpack.loss' has no attribute {name!r}")
  return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
  return sorted(list(globals()) + __all__)

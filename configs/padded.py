"""The baseline: one document per row, padded to seq_len (no packing), same model and token budget.

Identical to `configs/packed.py` except `packing.strategy = "pad"`: every row holds a single
document (or one chunk of a long one) followed by padding, so the steps, rows and slots are the
same as the packed run's, but fewer of the slots hold real tokens.

  python -m train.main --config=configs/padded.py
"""

from __future__ import annotations

import ml_collections

from configs import packed


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Padded rows (strategy "pad"); `arg="smoke"` shrinks the run to seconds."""
  c = packed.base_config()
  c.packing.strategy = "pad"  # one document per row, padded
  return packed.finish(c, arg)

"""Stable integer argsorts that use NumPy's radix sort (16-bit keys) for speed."""

from __future__ import annotations

import numpy as np


def stable_argsort(keys: np.ndarray) -> np.ndarray:
  """Stable argsort of non-negative integer `keys` as int64 indices.

  NumPy radix-sorts 16-bit keys with `kind="stable"`; wider keys are sorted as a least-significant
  digit radix sort of 16-bit digits, which is much faster than a comparison sort on millions of
  small integers.
  """
  keys = np.asarray(keys)
  if keys.size == 0:
    return np.zeros(0, np.int64)
  high = int(keys.max())
  if int(keys.min()) < 0:
    raise ValueError(f"stable_argsort needs non-negative keys, got min {int(keys.min())}")
  if high <= 0xFFFF:
    return np.argsort(keys.astype(np.uint16, copy=False), kind="stable").astype(np.int64)
  if np.all(keys[1:] >= keys[:-1]):
    return np.arange(len(keys), dtype=np.int64)
  perm = None
  shift = 0
  while True:
    digit = ((keys if perm is None else keys[perm]) >> shift) & 0xFFFF
    step = np.argsort(digit.astype(np.uint16), kind="stable")
    perm = step if perm is None else perm[step]
    shift += 16
    if high >> shift == 0:
      return perm.astype(np.int64, copy=False)

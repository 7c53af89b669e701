"""Segment-id layouts and random q, k, v of the attention tests."""

import jax.numpy as jnp
import numpy as np


def layouts(s: int) -> np.ndarray:
  """Rows: one segment; length-1 segments; block-crossing segments + padding tail; all padding."""
  rows = np.zeros((4, s), np.int32)
  rows[0] = 1
  rows[1, : s // 2] = np.arange(1, s // 2 + 1)
  lengths = [50, 100, 3, 1, 37]
  pos = 0
  for i, n in enumerate(lengths):
    rows[2, pos:pos + n] = i + 1
    pos += n
  return rows


def random_inputs(seed, b, s, h, kh, d, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return mk(b, s, h, d), mk(b, s, kh, d), mk(b, s, kh, d), mk(b, s, h, d)


def random_rows(rng, n, s):
  rows = np.zeros((n, s), np.int32)
  for r in range(n):
    pos, sid = int(rng.integers(0, 3)), 1
    while pos < s:
      ln = int(rng.choice([1, 2, 7, 30, 64, 100, 200]))
      rows[r, pos:pos + ln] = sid if rng.random() > 0.1 else 0
      pos += ln + int(rng.random() < 0.2)
      sid += 1
  return rows

"""One source's documents in one mixture epoch, written into the epoch's compact arrays.

`draw_source` implements steps 1 and 2 of `segpack.Mixture` for source `i` of epoch `e`
(`T_i` its target, `N` its documents, `S` its tokens):

1. Whole cycles: while the target left is more than `S`, the source gives all its documents
   and the target left drops by `S` (`cycles`). That makes `F` whole cycles.
2. The last cycle follows `P = default_rng([seed, e, i, F]).permutation(N)`: documents are taken
   in the order of `P` until their tokens reach the target left (at most one document's length
   past it). These are the documents, in the order, that the documented rule draws last.
3. Whole cycle `c < F` gives every document once, in the order `P[Q_c]`: `Q_c` takes the
   positions of `P` in blocks of `BLOCK` (the last one shorter), the blocks in the order of one
   permutation and the positions inside every block in the order of another, both drawn from
   `default_rng([seed, e, i, c])`. `P` is a uniformly random order, so each cycle's order is one
   too; the cycles differ from one another by the blocks' order and the order inside them, so a
   document meets other neighbours in every cycle.

What it costs: one seeded permutation per source (NumPy's Fisher-Yates shuffle, the one that
must stay exact), one gather of the lengths through it when a whole cycle needs them, and per
whole cycle two gathers that read `P` and its lengths one block (in cache) at a time; nothing
per document in Python. The ids and lengths go straight into the caller's arrays, int32 where
they fit, so an epoch's draw holds 9 bytes per drawn document (ids, lengths, source index) and
its peak adds one source's `P` and lengths (12 bytes per document of that source).

Example: a source of 5 documents whose target is 2.5 times its tokens gives two whole cycles
(every document twice, each cycle in its own order), then documents in the order of
`default_rng([seed, e, i, 2]).permutation(5)` until half of its tokens are drawn.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

__all__ = ["BLOCK", "SLAB", "cycles", "draw_source", "index_dtype", "permutation"]

# Positions of `P` per block of a whole cycle's order (32 KiB of int64: in the L1/L2 cache).
BLOCK = 4096
# Documents handled per vectorized step (bounds the temporaries).
SLAB = 1 << 20


def cycles(total: int, target: float) -> tuple[int, float]:
  """`(F, target left for the last cycle)`: the whole cycles of a source of `total` tokens
  asked for `target` tokens, by repeated subtraction as the rule states (`total` > 0)."""
  remaining, full = float(target), 0
  while total < remaining:
    remaining -= total
    full += 1
  return full, remaining


def index_dtype(n: int) -> np.dtype:
  """int32 for ids below 2**31, else int64."""
  return np.dtype(np.int32 if n < 2**31 else np.int64)


def permutation(n: int, entropy: list[int]) -> np.ndarray:
  """`default_rng(entropy).permutation(n)` in `index_dtype(n)`: the same shuffle (its random
  draws depend only on `n`) of a smaller array."""
  out = np.arange(n, dtype=index_dtype(n))
  np.random.default_rng(entropy).shuffle(out)
  return out


def _block_orders(n: int, entropy: list[int]) -> Iterator[np.ndarray]:
  """`Q_c` of a whole cycle (step 3), a slab of positions at a time."""
  rng = np.random.default_rng(entropy)
  blocks = -(-n // BLOCK)
  order = rng.permutation(blocks)
  inner = rng.permutation(min(BLOCK, n))
  step = max(1, SLAB // BLOCK)
  for k in range(0, blocks, step):
    starts = order[k:k + step] * BLOCK
    positions = (starts[:, None] + inner[None, :]).reshape(-1)
    if n % BLOCK and (starts == (blocks - 1) * BLOCK).any():
      positions = positions[positions < n]  # the short last block: its own positions, shuffled
    yield positions


def _take_into(values: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
  """`out[:] = values[positions]`, without a temporary when the dtypes agree."""
  if values.dtype == out.dtype:
    np.take(values, positions, out=out, mode="clip")  # positions are in range: no checks
  else:
    out[:] = values[positions]


def _in_order(lengths: np.ndarray, last: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """`lengths[last]` in `dtype`, gathered a slab at a time (no int64 copy of it)."""
  out = np.empty(last.size, dtype)
  for k in range(0, last.size, SLAB):
    out[k:k + SLAB] = lengths[last[k:k + SLAB]]
  return out


def draw_source(lengths: np.ndarray, *, entropy: list[int], target: float, ids_out: np.ndarray,
                lengths_out: np.ndarray) -> tuple[int, int, int, int]:
  """Draws one source (module docstring) into the front of `ids_out` and `lengths_out`.

  Args:
    lengths: the source's document lengths (at least one token in all).
    entropy: `[seed, epoch, source]`; a cycle's generator is seeded by it and the cycle.
    target: the source's tokens to draw (> 0).
    ids_out, lengths_out: where the drawn documents and their lengths go, in draw order; they
      must hold `(F + 1) * N` entries (those past the documents drawn may be written).

  Returns:
    `(documents drawn, tokens drawn, fewest and most times a document was drawn)`.
  """
  n, total = int(lengths.size), int(lengths.sum())
  full, remaining = cycles(total, target)
  last = permutation(n, [*entropy, full])
  by_last = _in_order(lengths, last, lengths_out.dtype) if full else None
  pos = 0
  for c in range(full):
    for positions in _block_orders(n, [*entropy, c]):
      _take_into(last, positions, ids_out[pos:pos + positions.size])
      _take_into(by_last, positions, lengths_out[pos:pos + positions.size])
      pos += positions.size
  tokens = 0
  for k in range(0, n, SLAB):  # the last cycle, a slab at a time until the target is reached
    m = min(SLAB, n - k)
    ids, slab = ids_out[pos + k:pos + k + m], lengths_out[pos + k:pos + k + m]
    ids[:] = last[k:k + m]
    slab[:] = by_last[k:k + m] if by_last is not None else lengths[ids]
    cum = np.cumsum(slab, dtype=np.int64) + tokens
    if cum[-1] >= remaining:
      j = int(np.searchsorted(cum, remaining, side="left"))
      take, tokens = k + j + 1, int(cum[j])
      break
    tokens = int(cum[-1])
  else:
    raise AssertionError(f"the last cycle holds {tokens} tokens, fewer than {remaining}")
  fewest = full + (1 if take == n else 0)
  return pos + take, full * total + tokens, fewest, full + 1

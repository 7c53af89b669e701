"""The grid and the rows of the GPU checks (`segpack.bench.gpu_checks`), plain Python and NumPy.

A grid point is a backend at a dtype, head dim, sequence length, head layout (MHA or GQA) and
causality (`grid`; `FULL_GRID` for the `gpu` tests, `QUICK_GRID` and `CPU_GRID` for
`segpack bench gpu-report --quick` and `--platform cpu`). Its `Case` (`case_for`, `make_case`)
holds the segment ids: `PACKED_ROWS` rows of a real first-fit-decreasing packing plan
(`segpack.packing.plan`, lognormal document lengths of mean 800, documents longer than S split)
and edge rows (`edge_rows`: one document filling the row; length-1 segments, a padding gap and a
padding tail; all padding). Building the grid does no JAX work.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from segpack.attention.resources import next_pow2
from segpack.bench.attention import packed_rows
from segpack.errors import ArgumentError
from segpack.segments import segment_runs

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
NUM_HEADS = 4
GROUPS = {"mha": 1, "gqa": 4}  # query heads per kv head: H = K, or H = 4 K
PACKED_ROWS = 2
MIN_CUDNN_SEGMENT_BOUND = 32


@dataclasses.dataclass(frozen=True)
class GridAxes:
  """The values every axis of a check grid takes."""

  implementations: tuple[str, ...] = ("pallas", "cudnn")
  dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
  head_dims: tuple[int, ...] = (64, 80, 128, 256)
  seq_lens: tuple[int, ...] = (1000, 4096, 8192)
  heads: tuple[str, ...] = ("mha", "gqa")
  causal: tuple[bool, ...] = (True, False)


FULL_GRID = GridAxes()
QUICK_GRID = GridAxes(dtypes=("float32", "bfloat16"), head_dims=(80, 128),
                      seq_lens=(1000, 4096), heads=("gqa",))
# Pallas in interpret mode: a CPU run proves the code path, not the numbers.
CPU_GRID = GridAxes(dtypes=("bfloat16",), head_dims=(80,), seq_lens=(200,), heads=("gqa",),
                    causal=(True,))


@dataclasses.dataclass(frozen=True)
class GridPoint:
  """One check: a backend at a dtype, head dim, sequence length, head layout and causality."""

  implementation: str
  dtype: str
  head_dim: int
  seq_len: int
  heads: str
  causal: bool

  @property
  def id(self) -> str:
    """A readable test id, e.g. `pallas-bf16-D128-S4096-gqa-causal`."""
    return (f"{self.implementation}-{SHORT_DTYPES[self.dtype]}-D{self.head_dim}-S{self.seq_len}-"
            f"{self.heads}-{'causal' if self.causal else 'full'}")

  @property
  def group(self) -> tuple:
    """Everything but the backend: points with the same group share one yardstick."""
    return (self.seq_len, self.head_dim, self.heads, self.causal, self.dtype)


def grid(axes: GridAxes = FULL_GRID) -> list[GridPoint]:
  """Every point of `axes`; the backend varies fastest, then dtype, so yardsticks are shared."""
  return [GridPoint(implementation=impl, dtype=dtype, head_dim=d, seq_len=s, heads=heads,
                    causal=causal)
          for s in axes.seq_lens for d in axes.head_dims for heads in axes.heads
          for causal in axes.causal for dtype in axes.dtypes for impl in axes.implementations]


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
  """Segment ids and head layout of one grid point.

  Attributes:
    segment_ids: int32 `[B, S]`, 0 = padding.
    row_kinds: what each row is.
    num_heads: H.
    num_kv_heads: K.
    head_dim: D.
    seed: seeds the rows and the random inputs.
  """

  segment_ids: np.ndarray
  row_kinds: tuple[str, ...]
  num_heads: int
  num_kv_heads: int
  head_dim: int
  seed: int

  @property
  def shape(self) -> tuple[int, int, int, int, int]:
    """`(B, S, H, K, D)`."""
    b, s = self.segment_ids.shape
    return b, s, self.num_heads, self.num_kv_heads, self.head_dim

  @property
  def cudnn_segment_bound(self) -> int:
    """cuDNN's static N: a power of two >= 32 and >= every row's segments plus padding runs."""
    start_BxS, _ = segment_runs(np.asarray(self.segment_ids))
    runs = int((start_BxS == np.arange(start_BxS.shape[1])).sum(axis=1).max())
    return max(MIN_CUDNN_SEGMENT_BOUND, next_pow2(runs))


def edge_rows(seq_len: int) -> tuple[np.ndarray, tuple[str, ...]]:
  """Hand-made rows: one document filling the row; length-1 segments, other short documents, a
  padding gap, a long document and a padding tail (ids descending: ids need not be ordered); all
  padding. `seq_len` >= 64.
  """
  if seq_len < 64:
    raise ArgumentError(f"edge_rows: seq_len must be >= 64, got {seq_len}")
  rows = np.zeros((3, seq_len), np.int32)
  rows[0] = 1
  tail, gap = max(1, seq_len // 10), 5
  pieces, pos = [], 0
  for n in [1] * 8 + [3, 50, 100, 1, 37]:
    if pos + n > seq_len // 2:
      break
    pieces.append((pos, n))
    pos += n
  pieces.append((pos + gap, seq_len - tail - pos - gap))
  for i, (start, n) in enumerate(pieces):
    rows[1, start:start + n] = len(pieces) - i
  kinds = ("one document", "length-1 segments, padding gap and tail", "all padding")
  return rows, kinds


def make_case(*, seq_len: int, head_dim: int, num_heads: int = NUM_HEADS,
              num_kv_heads: int = NUM_HEADS, seed: int = 0) -> Case:
  """`PACKED_ROWS` rows of a real FFD packing plan, then the `edge_rows`."""
  packed, source = packed_rows(seq_len, num_rows=PACKED_ROWS, mean=800.0, sigma=1.0, seed=seed)
  edges, edge_kinds = edge_rows(seq_len)
  return Case(segment_ids=np.concatenate([packed, edges]).astype(np.int32),
              row_kinds=(f"packed ({source})",) * PACKED_ROWS + edge_kinds, num_heads=num_heads,
              num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed)


def case_for(point: GridPoint, *, seed: int = 0) -> Case:
  """The case of a grid point: H = `NUM_HEADS`, K = H / `GROUPS[point.heads]`."""
  return make_case(seq_len=point.seq_len, head_dim=point.head_dim, num_heads=NUM_HEADS,
                   num_kv_heads=NUM_HEADS // GROUPS[point.heads], seed=seed)

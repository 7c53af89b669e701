"""Segment attention benchmark: tiles computed versus dense and ideal; GPU time and TFLOP/s.

    segpack bench attention [--json] [--plot out.png]     # or python -m segpack.bench.attention

Rows come from real packing (`segpack.packing.plan`, first-fit-decreasing) of document lengths:
`--lengths lognormal` (default; `--mean 800 --sigma 1.0`, a larger sigma is a longer tail) or
`--lengths builtin` (the built-in corpus's training documents, with BOS and EOS). For every
(seq_len, head_dim) it reports, summed over the benchmark rows and per head:

- `tiles_computed`: (query block, key block) tiles the segment kernel's forward visits;
- `tiles_dense`: tiles a causal dense-mask flash kernel visits (every block at or below the
  diagonal);
- `tiles_ideal`: the causal tiles each segment needs on its own (block-aligned), summed;
- `tiles_masked`: of the computed tiles, those that need the element-wise mask.

On a GPU it also times forward and forward+backward of the segment kernel, the XLA dense mask,
the dense-mask kernel of the same family (`skip_blocks=False`), JAX's Pallas `mha` with
`segment_ids`, and (where they run) cuDNN on segpack's packed layout (JAX's fused attention with
per-document lengths and offsets) and `jax.nn.dot_product_attention(implementation="cudnn")` with
a dense per-document mask, and reports TFLOP/s on useful FLOPs (the causal per-document attention
FLOPs) and, for segpack's Pallas kernel, on the tiles it computes. `--sweep` also times segpack's
Pallas kernel under the settings of `SWEEP` (blocks, warps, stages). Elsewhere those columns say
"not measured".
"""

from __future__ import annotations

import argparse
import datetime
import functools
import io
import json
import os
import pathlib
import sys
import time
from typing import Any, Callable, Sequence

import jax
from jax.experimental.pallas.ops.gpu import attention as jax_attention
import jax.numpy as jnp
import numpy as np

from segpack import packing
from segpack.attention import blocks
from segpack.attention import PallasOptions, segment_attention
from segpack.attention.pallas import segment_attention_pallas
from segpack.bench import attention_context
from segpack.bench import tables
from segpack.data import attention_cost
from segpack import errors
from segpack.files import atomic_write_bytes
from segpack.segments import segment_runs

NOT_MEASURED = "not measured"
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}


def lognormal_lengths(n: int, *, mean: float, sigma: float, seed: int) -> np.ndarray:
  """`n` lengths, lognormal with the given mean (not median), rounded, at least 1."""
  mu = np.log(mean) - sigma**2 / 2
  return np.maximum(1, np.round(np.random.default_rng(seed).lognormal(mu, sigma, n))).astype(
      np.int64)


def builtin_lengths() -> np.ndarray:
  """The built-in corpus's training documents' lengths, each + 2 for BOS and EOS (as trained)."""
  from segpack import shards  # optional: builds or opens the corpus, only for --lengths builtin
  from segpack.text import corpus  # optional: as above
  return np.asarray(shards.ShardSource(corpus.ensure_builtin(size="full").train_dir).lengths,
                    np.int64) + 2


def packed_rows(seq_len: int, *, num_rows: int, mean: float, sigma: float, seed: int,
                lengths: np.ndarray | None = None) -> tuple[np.ndarray, str]:
  """`[num_rows, seq_len]` segment ids of rows drawn at random from a real packing plan of
  `lengths` (None: lognormal lengths of `mean` and `sigma`), in the order drawn, so that any
  first rows are a random sample too; fewer rows when the plan has fewer."""
  if lengths is None:
    lengths = lognormal_lengths(max(64, 8 * num_rows * seq_len // int(mean)), mean=mean,
                                sigma=sigma, seed=seed)
  p = packing.plan(lengths, seq_len, strategy="ffd")
  splits = np.asarray(p.row_splits)
  piece_len = np.asarray(p.length)
  rows = [list(piece_len[splits[r]:splits[r + 1]]) for r in range(p.num_rows)]
  source = "segpack.packing.plan(ffd)"
  num_rows = min(num_rows, len(rows))
  # In drawn order, not the plan's: the timing takes the first rows, and FFD's first rows hold
  # the longest documents (one a row), so a prefix of the plan's order is no sample of its rows.
  picks = np.random.default_rng(seed).choice(len(rows), size=num_rows, replace=False)
  seg = np.zeros((num_rows, seq_len), np.int32)
  for out_row, r in enumerate(picks):
    seg[out_row, :sum(rows[r])] = np.repeat(np.arange(1, len(rows[r]) + 1), rows[r])
  return seg, source


def _segment_lengths(row: np.ndarray) -> np.ndarray:
  """The lengths of a row's segments (its non-padding runs, `segment_runs`), in row order."""
  start_1xS, end_1xS = segment_runs(np.asarray(row)[None])
  first_S = (start_1xS[0] == np.arange(len(row))) & (np.asarray(row) != 0)
  return (end_1xS[0] - start_1xS[0])[first_S]


def ideal_tiles(length: int, block_q: int, block_k: int) -> int:
  """Causal tiles of one block-aligned segment: sum over its query blocks of key blocks needed."""
  q_ends = np.minimum(np.arange(1, -(-length // block_q) + 1) * block_q, length)
  return int((-(-q_ends // block_k)).sum())


def tile_counts(seg: np.ndarray, *, block_q: int, block_k: int) -> dict[str, int]:
  """Tile counts of the benchmark rows (per head), causal."""
  seg_j = jnp.asarray(seg)
  ranges = np.asarray(blocks.q_block_ranges(seg_j, block_q=block_q, block_k=block_k,
                                            causal=True))
  computed = int((ranges[..., 1] - ranges[..., 0]).sum())
  masked = computed - int((ranges[..., 3] - ranges[..., 2]).sum())
  nq = seg.shape[1] // block_q
  dense_row = int((-(-(np.arange(1, nq + 1) * block_q) // block_k)).sum())
  ideal = sum(ideal_tiles(int(n), block_q, block_k) for row in seg for n in _segment_lengths(row))
  return dict(tiles_computed=computed, tiles_dense=dense_row * len(seg), tiles_ideal=ideal,
              tiles_masked=masked)


def useful_flops(seg: np.ndarray, *, heads: int, head_dim: int) -> float:
  """Forward FLOPs of causal per-document attention: 2 matmuls x 2 FLOPs x the (query, key)
  pairs (`segpack.data.attention_cost.row_attention_cost`) x D."""
  pairs = int(attention_cost.row_attention_cost(np.asarray(seg)).sum())
  return 4.0 * pairs * head_dim * heads


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
  jax.block_until_ready(fn())  # compile and warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def _implementations(cudnn_segment_bound: int, block: int, interpret: bool = False
                     ) -> dict[str, Callable[..., jax.Array]]:
  """The attention functions timed on a GPU, each `(q, k, v, seg) -> out`, causal.

  `interpret=True` runs the Pallas ones in interpret mode (to check this code on a CPU);
  `cudnn_segment_bound` is cuDNN's static bound on segments per row.
  """

  def jax_mha(q, k, v, seg):
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # mha has no grouped-query heads
    sizes = jax_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=block // 2,
                                     block_kv_dkv=block // 2, block_q_dq=block // 2,
                                     block_kv_dq=block // 2)
    return jax_attention.mha(q, k, v, seg, sm_scale=q.shape[-1]**-0.5, causal=True,
                             block_sizes=sizes, interpret=interpret)

  def dpa_cudnn_mask(q, k, v, seg):
    # The public API's per-document masking: a dense [B, 1, S, S] mask (same document, causal;
    # padding slots see each other), cuDNN's fused kernel with it as a bias.
    s = seg.shape[1]
    mask = (seg[:, None, :, None] == seg[:, None, None, :]) & jnp.tril(jnp.ones((s, s), bool))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")

  pallas = PallasOptions(block_q=block, block_k=block, interpret=interpret)  # both Pallas kernels
  return {
      "segment": lambda q, k, v, seg: segment_attention(
          q, k, v, seg, implementation="pallas", pallas=pallas),
      "pallas_dense": lambda q, k, v, seg: segment_attention_pallas(
          q, k, v, seg, causal=True, scale=q.shape[-1]**-0.5, pallas=pallas, skip_blocks=False),
      "xla_dense": lambda q, k, v, seg: segment_attention(q, k, v, seg, implementation="xla"),
      "jax_mha": jax_mha,
      "cudnn": lambda q, k, v, seg: segment_attention(
          q, k, v, seg, implementation="cudnn", cudnn_segment_bound=cudnn_segment_bound),
      "dpa_cudnn_mask": dpa_cudnn_mask,
  }


# `--sweep`: segpack's Pallas kernel under other settings than the benchmark's (forward blocks
# `--block`, backward and the rest "auto"), each a `PallasOptions` override; name -> fields.
SWEEP: dict[str, dict[str, int]] = {
    "warps8": dict(num_warps=8),  # every kernel 8 warps (the 16-bit backward at D >= 128 was)
    "stages3": dict(num_stages=3),
    "bwd64x64": dict(block_q_bwd=64, block_k_bwd=64),
    "bwd128x64": dict(block_q_bwd=128, block_k_bwd=64),
    "bwd128x64w8": dict(block_q_bwd=128, block_k_bwd=64, num_warps=8),
}


def sweep_implementations(block: int, interpret: bool = False
                          ) -> dict[str, Callable[..., jax.Array]]:
  """segpack's Pallas kernel under every `SWEEP` setting, named `segment_<setting>`."""
  out = {}
  for name, fields in SWEEP.items():
    options = PallasOptions(**{"block_q": block, "block_k": block, "interpret": interpret,
                               **fields})
    out[f"segment_{name}"] = functools.partial(_pallas_with, options)
  return out


def _pallas_with(options: PallasOptions, q, k, v, seg):
  return segment_attention(q, k, v, seg, implementation="pallas", pallas=options)


def _time_one(fn: Callable[..., jax.Array], q, k, v, seg_j, dout, *, repeats: int
              ) -> tuple[float, float]:
  """Median forward and forward+backward milliseconds of `fn` (each jitted, warmed up once)."""
  fwd = jax.jit(fn)

  @jax.jit
  def fwd_bwd(q, k, v, seg, dout):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return out, vjp(dout)

  fwd_ms = _median_ms(lambda: fwd(q, k, v, seg_j), repeats)
  return fwd_ms, _median_ms(lambda: fwd_bwd(q, k, v, seg_j, dout), repeats)


def time_config(seg: np.ndarray, *, heads: int, kv_heads: int, head_dim: int, block: int,
                repeats: int, peak_tflops: float | None, interpret: bool = False,
                sweep: bool = False) -> dict[str, Any]:
  """Forward and forward+backward times (ms) and TFLOP/s of every implementation.

  `<name>_fwdbwd_tflops` counts useful FLOPs (causal per-document pairs); for segpack's Pallas
  kernels `<name>_fwdbwd_tflops_computed` counts the FLOPs of the (block_q, block_k) tiles its
  forward computes at `--block` (3.5x the forward's for forward+backward, as for useful FLOPs).
  """
  b, s = seg.shape
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, s, heads, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kv_heads, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kv_heads, head_dim), jnp.bfloat16)
  dout = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
  seg_j = jnp.asarray(seg)
  flops = useful_flops(seg, heads=heads, head_dim=head_dim)
  tiles = tile_counts(seg, block_q=block, block_k=block)
  computed = tiles["tiles_computed"] * block * block * 4.0 * head_dim * heads
  documents = [len(_segment_lengths(r)) for r in seg]
  cudnn_segment_bound = max(documents)  # most segments
  impls = _implementations(cudnn_segment_bound, block, interpret)
  if sweep:
    impls.update(sweep_implementations(block, interpret))
  rec: dict[str, Any] = dict(
      useful_flops_fwd=flops, computed_flops_fwd=computed, timed_documents=sum(documents),
      timed_dense_over_computed=tiles["tiles_dense"] / tiles["tiles_computed"])
  for name, fn in impls.items():
    try:
      rec[f"{name}_fwd_ms"], ms = _time_one(fn, q, k, v, seg_j, dout, repeats=repeats)
    except Exception as e:  # pylint: disable=broad-except
      msg = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
      rec[f"{name}_fwd_ms"] = rec[f"{name}_fwdbwd_ms"] = msg
      continue
    rec[f"{name}_fwdbwd_ms"] = ms
    tflops = 3.5 * flops / (ms * 1e-3) / 1e12  # backward = 2.5 x forward FLOPs
    rec[f"{name}_fwdbwd_tflops"] = tflops
    if name.startswith("segment"):
      rec[f"{name}_fwdbwd_tflops_computed"] = 3.5 * computed / (ms * 1e-3) / 1e12
    if peak_tflops:
      rec[f"{name}_fwdbwd_peak_frac"] = tflops / peak_tflops
      if name.startswith("segment"):
        rec[f"{name}_fwdbwd_peak_frac_computed"] = (
            rec[f"{name}_fwdbwd_tflops_computed"] / peak_tflops)
  return rec


def _peak_tflops(device: jax.Device) -> float | None:
  kind = device.device_kind
  return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in kind), None)


def run(args: argparse.Namespace,
        on_record: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
  """Every (seq_len, head_dim) config: one record, passed to `on_record` as soon as measured."""
  on_gpu = jax.default_backend() == "gpu"
  device = jax.devices()[0]
  results = []
  lengths = builtin_lengths() if args.lengths == "builtin" else None
  for s in args.seq_lens:
    seg, source = packed_rows(s, num_rows=args.rows, mean=args.mean, sigma=args.sigma,
                              seed=args.seed, lengths=lengths)
    counts = tile_counts(seg, block_q=args.block, block_k=args.block)
    for d in args.head_dims:
      rec = dict(seq_len=s, head_dim=d, block_q=args.block, block_k=args.block, rows=len(seg),
                 packing=source, lengths=_lengths_name(args), **counts)
      rec["computed_over_ideal"] = counts["tiles_computed"] / counts["tiles_ideal"]
      rec["dense_over_computed"] = counts["tiles_dense"] / counts["tiles_computed"]
      if on_gpu or args.interpret:
        b = max(1, min(len(seg), args.tokens // s))
        rec.update(batch=b, heads=args.heads, kv_heads=args.kv_heads, device=device.device_kind)
        rec.update(time_config(seg[:b], heads=args.heads, kv_heads=args.kv_heads, head_dim=d,
                               block=args.block, repeats=args.repeats,
                               peak_tflops=_peak_tflops(device), interpret=args.interpret,
                               sweep=args.sweep))
      else:
        rec.update(device=f"{device.platform} ({device.device_kind})", timings=NOT_MEASURED)
      rec["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
      results.append(rec)
      if on_record is not None:
        on_record(rec)
  return results


def _lengths_name(args: argparse.Namespace) -> str:
  if args.lengths == "builtin":
    return "builtin corpus (train split, +BOS/EOS)"
  return f"lognormal(mean {args.mean:g}, sigma {args.sigma:g})"


def _fmt(x: Any, spec: str) -> str:
  return format(x, spec) if isinstance(x, (int, float)) else NOT_MEASURED


def format_table(results: list[dict[str, Any]]) -> str:
  """A fixed-width table: tile counts for every config; GPU times where measured."""
  head = (f"{'S':>6} {'D':>4} {'blk':>4} {'computed':>9} {'dense':>9} {'ideal':>9} "
          f"{'comp/ideal':>10} {'dense/comp':>10} {'masked%':>7} | {'seg f+b ms':>12} "
          f"{'TFLOP/s':>12} {'x xla':>12} {'x dense':>12} {'x mha':>12}")
  return tables.table(head, (_table_row(r) for r in results))


def _table_row(r: dict[str, Any]) -> str:
  """One config's line of `format_table`."""
  seg_ms = r.get("segment_fwdbwd_ms")
  speed = lambda other: (_fmt(r[other] / seg_ms, ".2f") if isinstance(seg_ms, float)
                         and isinstance(r.get(other), float) else NOT_MEASURED)
  return (
      f"{r['seq_len']:>6} {r['head_dim']:>4} {r['block_q']:>4} {r['tiles_computed']:>9} "
      f"{r['tiles_dense']:>9} {r['tiles_ideal']:>9} {r['computed_over_ideal']:>10.3f} "
      f"{r['dense_over_computed']:>10.2f} "
      f"{100 * r['tiles_masked'] / r['tiles_computed']:>7.1f} | {_fmt(seg_ms, '.3f'):>12} "
      f"{_fmt(r.get('segment_fwdbwd_tflops'), '.1f'):>12} {speed('xla_dense_fwdbwd_ms'):>12} "
      f"{speed('pallas_dense_fwdbwd_ms'):>12} {speed('jax_mha_fwdbwd_ms'):>12}")


def plot(results: list[dict[str, Any]], path: str) -> None:
  """Tiles (computed, dense, ideal) against S and, if measured, forward+backward times."""
  import matplotlib  # optional: the [plot] extra, needed only with --plot
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # optional: the [plot] extra, after choosing Agg
  timed = any(isinstance(r.get("segment_fwdbwd_ms"), float) for r in results)
  fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12 if timed else 6, 4.5), squeeze=False)
  ax = axes[0, 0]
  d0 = results[0]["head_dim"]
  rows = [r for r in results if r["head_dim"] == d0]
  s = [r["seq_len"] for r in rows]
  for key in ("tiles_dense", "tiles_computed", "tiles_ideal"):
    ax.plot(s, [r[key] / r["rows"] for r in rows], marker="o", label=key[6:])
  ax.set(xscale="log", yscale="log", xlabel="sequence length S", ylabel="KV tiles per row and head",
         title=f"block {rows[0]['block_q']}, lognormal(mean 800) packed rows")
  ax.legend()
  if timed:
    ax = axes[0, 1]
    for r_d in sorted({r["head_dim"] for r in results}):
      sub = [r for r in results if r["head_dim"] == r_d]
      for impl in ("segment", "pallas_dense", "xla_dense", "jax_mha", "cudnn"):
        pts = [(r["seq_len"], r.get(f"{impl}_fwdbwd_ms")) for r in sub]
        pts = [(x, y) for x, y in pts if isinstance(y, float)]
        if pts:
          ax.plot(*zip(*pts), marker="o", label=f"{impl} D={r_d}")
    ax.set(xscale="log", yscale="log", xlabel="sequence length S", ylabel="fwd+bwd ms",
           title=results[0]["device"])
    ax.legend(fontsize=7)
  fig.tight_layout()
  # Atomic (temporary file in the same directory, then rename); the extension picks the format.
  buf = io.BytesIO()
  try:
    fig.savefig(buf, dpi=120, format=os.path.splitext(path)[1].lstrip(".") or "png")
  finally:
    plt.close(fig)
  atomic_write_bytes(pathlib.Path(path), buf.getvalue())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line of `main`, also for running `run` in-process (`segpack.bench.gpu_report`)."""
  ap = argparse.ArgumentParser(prog="segpack bench attention", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
  ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  ap.add_argument("--block", type=int, default=128, help="block_q = block_k")
  ap.add_argument("--rows", type=int, default=32, help="packed rows per config for tile counts")
  ap.add_argument("--tokens", type=int, default=32768, help="GPU timing: B = tokens // S rows")
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--lengths", choices=("lognormal", "builtin"), default="lognormal",
                  help="document lengths: lognormal (--mean, --sigma) or the built-in corpus's")
  ap.add_argument("--mean", type=float, default=800.0)
  ap.add_argument("--sigma", type=float, default=1.0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--interpret", action="store_true",
                  help="run the GPU timing path in Pallas interpret mode (checks the code on a "
                  "CPU; the times mean nothing)")
  ap.add_argument("--sweep", action="store_true",
                  help="also time segpack's Pallas kernel under the settings of SWEEP")
  ap.add_argument("--json", action="store_true", help="one JSON record per config, one a line")
  ap.add_argument("--plot", default=None, help="write a PNG plot here")
  ap.add_argument("--context", action="store_true",
                  help="the context-parallel balance benchmark instead, with its own flags "
                  "(segpack.bench.attention_context: --context --help)")
  return ap.parse_args(argv)


@errors.command("segpack bench attention")
def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--context" in argv:
    return attention_context.main([a for a in argv if a != "--context"])
  args = parse_args(argv)
  # With --json each record is printed (and flushed) as soon as it is measured.
  results = run(args, on_record=(lambda r: print(json.dumps(r), flush=True)) if args.json
                else None)
  if not args.json:
    print(format_table(results))
  if not args.json and results and results[0].get("timings") == NOT_MEASURED:
    print(f"\nGPU timings: {NOT_MEASURED} (backend: {jax.default_backend()}).")
  if args.plot:
    plot(results, args.plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Context-parallel balance: the busiest device's attention cost over the mean, and CP traffic.

    segpack bench attention --context [--json]   # or python -m segpack.bench.attention_context

Rows come from real packing (`segpack.packing.plan`, first-fit-decreasing) of lognormal document
lengths (mean 800 and mean 8000, sigma 1.0; documents longer than S are split), rows drawn at
random from the plan. For every (mean, S, cp) it reports, per row and then averaged over the
rows (`rows` says how many):

- `max_over_mean_{none,zigzag,documents}`: the largest device's attention cost (the sum of its
  queries' causal key counts, `segpack.data.context_order.device_costs`) over the mean device cost,
  for the contiguous, zigzag and document-aware orders (`segpack.data.context_order.context_order`);
  1.0 is perfect balance. `worst_documents` is the largest ratio over the rows.
- `order_ms`: the median time of one `context_order(..., balance="documents")` call on one row
  (NumPy, this machine).
- `comm_bytes_per_layer`: the bytes each device receives per layer and row with all-gather CP
  (`segpack.attention.context_parallel.context_comm_bytes`, "total": the forward all-gather of k, v
  and the int32 segment ids and slot indices, the backward reduce-scatter of dk and dv), for the
  model dims `KV_HEADS`, `HEAD_DIM`, bf16.

- `step_ms`, `step_ratio`: on a GPU with at least cp devices, the median forward + backward time
  of context-parallel `segment_attention` (`--step-implementation`, Pallas by default; H =
  `HEADS`, the K, D and dtype above) on the first `--step-rows` rows, for each order
  (`segpack.bench.context_step.time_orders`), and its ratio to the contiguous order; elsewhere
  "not yet measured", `step_note` saying why.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any, Sequence

import numpy as np

from segpack import packing
from segpack.attention.context_parallel import context_comm_bytes
from segpack.bench import context_step
from segpack.bench import tables
from segpack.data import context_order as order_lib

NOT_MEASURED = context_step.NOT_MEASURED
HEADS = 32
KV_HEADS = 8
HEAD_DIM = 128
DTYPE_BYTES = 2  # bf16


def packed_rows(seq_len: int, *, num_rows: int, mean: float, sigma: float,
                seed: int) -> np.ndarray:
  """`[num_rows, seq_len]` segment ids of rows drawn at random from an FFD plan.

  The plan packs about `8 * num_rows` rows' worth of lognormal lengths (mean `mean`, not median);
  segment ids run 1..k in each row, padding (0) at the end.
  """
  rng = np.random.default_rng(seed)
  mu = np.log(mean) - sigma**2 / 2
  count = max(64, int(8 * num_rows * seq_len / mean))
  lengths = np.maximum(1, np.round(rng.lognormal(mu, sigma, count))).astype(np.int64)
  plan = packing.plan(lengths, seq_len, strategy="ffd")
  splits = np.asarray(plan.row_splits, np.int64)
  piece_len = np.asarray(plan.length, np.int64)
  picks = np.sort(rng.choice(plan.num_rows, size=min(num_rows, plan.num_rows), replace=False))
  seg = np.zeros((len(picks), seq_len), np.int32)
  for out_row, r in enumerate(picks):
    row_lengths = piece_len[splits[r]:splits[r + 1]]
    ids = np.repeat(np.arange(1, len(row_lengths) + 1, dtype=np.int32), row_lengths)
    seg[out_row, :len(ids)] = ids
  return seg


def balance_ratios(seg_BxS: np.ndarray, *, context_size: int) -> dict[str, np.ndarray]:
  """Per row, the largest device's cost over the mean device cost, for every balance.

  Rows without tokens are left out (their ratio is undefined).
  """
  keep = (seg_BxS != 0).any(axis=1)
  seg_BxS = seg_BxS[keep]
  out = {}
  for balance in order_lib.CONTEXT_BALANCES:
    index = order_lib.context_order(segment_ids_BxS=seg_BxS, context_size=context_size,
                                    balance=balance)
    costs_BxP = order_lib.device_costs(segment_ids_BxS=seg_BxS, slot_index_BxS=index,
                                       context_size=context_size).astype(np.float64)
    out[balance] = costs_BxP.max(axis=1) / costs_BxP.mean(axis=1)
  return out


def _order_ms(row_S: np.ndarray, *, context_size: int, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    order_lib.context_order(segment_ids_BxS=row_S[None], context_size=context_size,
                            balance="documents")
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def step_times(seg_BxS: np.ndarray, *, context_size: int,
               args: argparse.Namespace) -> dict[str, Any]:
  """`step_ms` and `step_ratio` per balance where `context_step` can measure, else a note."""
  reason = context_step.skip_reason(context_size)
  if reason:
    return dict(step_ms=NOT_MEASURED, step_note=reason)
  try:
    records = context_step.time_orders(
        mesh=context_step.context_mesh(context_size), segment_ids_BxS=seg_BxS[:args.step_rows],
        heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
        implementation=args.step_implementation, repeats=args.step_repeats)
  except Exception as e:  # pylint: disable=broad-except  # e.g. out of memory at large S
    return dict(step_ms="failed", step_note=f"{type(e).__name__}: {str(e)[:300]}")
  return dict(step_ms={r["balance"]: r["step_ms"] for r in records},
              step_ratio={r["balance"]: r["ratio_to_none"] for r in records},
              step_rows=records[0]["rows"], heads=HEADS,
              step_implementation=args.step_implementation)


def rows_for(seq_len: int, args: argparse.Namespace) -> int:
  """Rows per (mean, S): `tokens // S`, clipped to `[min_rows, rows]`."""
  return min(args.rows, max(args.min_rows, args.tokens // seq_len))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
  """Every (mean, S, cp): one record."""
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
  results = []
  for mean in args.means:
    for s in args.seq_lens:
      seg = packed_rows(s, num_rows=rows_for(s, args), mean=mean, sigma=args.sigma,
                        seed=args.seed)
      for cp in args.context_sizes:
        ratios = balance_ratios(seg, context_size=cp)
        rec: dict[str, Any] = dict(mean=mean, sigma=args.sigma, seq_len=s, context_size=cp,
                                   rows=int(len(ratios["none"])),
                                   packing="segpack.packing.plan(ffd)")
        for balance, r in ratios.items():
          rec[f"max_over_mean_{balance}"] = float(r.mean())
        rec["worst_documents"] = float(ratios["documents"].max())
        rec["order_ms"] = _order_ms(seg[0], context_size=cp, repeats=args.repeats)
        rec.update(kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
                   comm_bytes_per_layer=context_comm_bytes(
                       seq_len=s, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       dtype_bytes=DTYPE_BYTES, context_size=cp)["total"],
                   date=date)
        rec.update(step_times(seg, context_size=cp, args=args))
        results.append(rec)
  return results


def _steps(rec: dict[str, Any]) -> str:
  """`none / zigzag / documents` step ms and the documents-to-contiguous ratio, or the note."""
  ms = rec["step_ms"]
  if not isinstance(ms, dict):
    return f"{ms} ({rec['step_note']})" if rec.get("step_note") else str(ms)
  return (" / ".join(f"{ms[b]:.2f}" for b in order_lib.CONTEXT_BALANCES)
          + f" (documents {rec['step_ratio']['documents']:.3f}x)")


def format_table(results: list[dict[str, Any]]) -> str:
  """A fixed-width table, one line per (mean, S, cp)."""
  head = (f"{'mean':>5} {'S':>8} {'cp':>3} {'rows':>4} | {'contiguous':>10} {'zigzag':>7} "
          f"{'documents':>9} {'worst doc':>9} | {'comm MiB':>9} {'order ms':>8} | "
          f"step ms: contiguous / zigzag / documents")
  return tables.table(head, (
      f"{r['mean']:>5.0f} {r['seq_len']:>8} {r['context_size']:>3} {r['rows']:>4} | "
      f"{r['max_over_mean_none']:>10.3f} {r['max_over_mean_zigzag']:>7.3f} "
      f"{r['max_over_mean_documents']:>9.3f} {r['worst_documents']:>9.3f} | "
      f"{r['comm_bytes_per_layer'] / 2**20:>9.1f} {r['order_ms']:>8.1f} | {_steps(r)}"
      for r in results))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line of `main`."""
  ap = argparse.ArgumentParser(prog="segpack bench attention --context", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072, 1048576])
  ap.add_argument("--context-sizes", type=int, nargs="+", default=[2, 4, 8])
  ap.add_argument("--means", type=float, nargs="+", default=[800.0, 8000.0])
  ap.add_argument("--sigma", type=float, default=1.0)
  ap.add_argument("--rows", type=int, default=32, help="most rows per (mean, S)")
  ap.add_argument("--min-rows", type=int, default=8, help="fewest rows per (mean, S)")
  ap.add_argument("--tokens", type=int, default=2**22,
                  help="rows per (mean, S) = tokens // S, clipped to [min-rows, rows]")
  ap.add_argument("--repeats", type=int, default=5, help="timings of context_order")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--step-rows", type=int, default=1, help="rows timed per (mean, S, cp), GPU")
  ap.add_argument("--step-repeats", type=int, default=5, help="timed steps per order, GPU")
  ap.add_argument("--step-implementation", choices=("pallas", "xla"), default="pallas",
                  help="the attention backend timed on a GPU")
  ap.add_argument("--json", action="store_true", help="one JSON record per config, one a line")
  args = ap.parse_args(argv)
  for name in ("seq_lens", "context_sizes"):
    for v in getattr(args, name):
      if v < 1:
        ap.error(f"--{name.replace('_', '-')} must be positive, got {v}")
  for s in args.seq_lens:
    for cp in args.context_sizes:
      if s % (2 * cp):
        ap.error(f"--seq-lens {s} is not divisible by 2 x --context-sizes {cp}")
  counts = (args.rows, args.min_rows, args.repeats, args.step_rows, args.step_repeats)
  if min(counts) < 1 or min(args.means) <= 0:
    ap.error("--rows, --min-rows, --repeats, --step-rows, --step-repeats and --means must be "
             "positive")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  results = run(args)
  tables.print_results(results, as_json=args.json, format_table=format_table)
  if not args.json:
    print(f"\nmax / mean: the busiest device's causal attention cost over the mean, averaged over "
          f"the rows. comm: MiB each device receives per layer and row (all-gather CP, "
          f"K={KV_HEADS}, D={HEAD_DIM}, bf16). step ms: median forward + backward of "
          f"context-parallel attention (H={HEADS}) per order, on a GPU with cp devices; "
          f"elsewhere {NOT_MEASURED}.")
  return 0


if __name__ == "__main__":
  sys.exit(main())

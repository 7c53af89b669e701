"""`segpack bench packing`: planning speed and quality, Grain's packers, loading speed.

Also `python -m segpack.bench.packing` (the same flags).

Prints a table (or JSON with `--json`). Sections:

- `plan`: segpack's exact packers on lognormal document lengths (mean 800, sigma 1.0 by
  default: mu = ln(800) - sigma^2 / 2) at seq_len 4096: wall and CPU seconds (best of
  `--repeats`), documents/s, rows against the lower bound ceil(tokens / seq_len), plan bytes per
  document.
- `grain`: `grain.experimental.FirstFitPackIterDataset` / `BestFitPackIterDataset` on the first
  `--grain-docs` documents, against segpack's packer on the same documents (the ratio).
- `load`: batches of `--batch-size` x seq_len with all four features through
  `segpack.pack_dataset` from a memory-mapped synthetic shard dataset.
- `builtin`: the packers on the built-in corpus (`segpack.text.corpus.ensure_builtin`).
- `balance`: `--balance-docs` lognormal documents, FFD-planned at `--balance-seq-len`, in
  global batches of `--balance-batch` rows over `--balance-ranks` ranks: the largest rank's
  causal attention cost over the mean, in the epoch permutation's order and balanced
  (`segpack.data.balance`), and an ESTIMATE on paper of the step time the slowest rank saves.
- `scale`: `--scale-docs` lognormal documents (e.g. 100,000,000) as an int32 `.npy` file, loaded
  and planned (FFD, BOS + EOS) by a fresh subprocess: plan seconds, its peak RSS with and without
  the input lengths (bytes per document), the plan's bytes per document, and the save and
  memory-mapped reload of the plan. `--sections scale --scale-docs 100000000` runs only it.
- `repack`: `--repack-docs` lognormal documents, FFD at seq_len, BOS + EOS: the fixed plan
  against `repack="epoch"`'s plans: epoch 1 from scratch (`tie_seed=(0, 1)`) and the later
  epochs through `packing.RepackPlanner` (chunks and rows reused): plan seconds (best of
  `--repeats`), utilization, whether the row lengths equal the fixed plan's, and the share of
  the pairs of documents sharing a row in the fixed plan that share one again (100% for it).
- `mixture`: three sources of `--mixture-docs` lognormal documents each (means 300, 800 and 3000,
  sigma `--sigma`), weights 0.5 / 0.3 / 0.2 (`segpack.bench.packing_mixture`). segpack draws one
  mixture epoch (`MixtureDraws.draw(0)`) and plans it (FFD, BOS + EOS) in a fresh process: draw
  and plan seconds, peak RSS per document, the token share of each source, rows, utilization.
  Side by side, on `--mixture-grain-docs` documents per source (Grain is slow): Grain's
  `MapDataset.mix` (weights of documents) then `FirstFitPackIterDataset` (`--grain-bins`): the
  token share of each source in the packed rows and tokens/s, and segpack on the same documents.
  It runs when `--sections` names it (10M documents per source unless `--mixture-docs` says
  otherwise) or when `--mixture-docs` is given. The peak RSS of the draw and of the plan are
  measured apart (per drawn document); `--mixture-before` adds, after each segpack row, the
  draw as it was before (`segpack.bench.mixture_baseline`) with the same plan.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from typing import Any, Sequence

from segpack import packing
from segpack import errors
from segpack.bench.packing_mixture import bench_mixture, mixture_notes
from segpack.bench.packing_sections import (bench_balance, bench_builtin, bench_grain,
                                            bench_load, bench_plan, bench_repack, bench_scale,
                                            lognormal_lengths)


# Documents per source of the mixture section when `--sections` names it and `--mixture-docs` is
# not given.
MIXTURE_DOCS = 10_000_000

_COLUMNS = (("section", "{}", 7), ("data", "{}", 30), ("case", "{}", 24),
            ("documents", "{:,}", 12), ("seconds", "{:.3f}", 9), ("cpu_seconds", "{:.3f}", 11),
            ("docs_per_s", "{:,.0f}", 13),
            ("rows_over_bound", "{:.6f}", 10), ("bytes_per_doc", "{:.1f}", 7),
            ("tokens_per_s", "{:,.0f}", 14))


def format_table(results: list[dict[str, Any]]) -> str:
  """The results as a table, one line each, then a note per grain, load, balance, repack, scale
  and mixture result."""
  head = "".join(f"{name:>{w}} " if i > 2 else f"{name:<{w}} "
                 for i, (name, _, w) in enumerate(_COLUMNS))
  lines = [head]
  for r in results:
    cells = []
    for i, (name, fmt, w) in enumerate(_COLUMNS):
      text = fmt.format(r[name]) if name in r else "-"
      cells.append(f"{text:>{w}} " if i > 2 else f"{text:<{w}} ")
    lines.append("".join(cells))
  notes = [f"{r['case']}: segpack {r['segpack_strategy']} is {r['segpack_over_grain']:,.0f}x "
           f"faster (num_packing_bins={r['num_packing_bins']})"
           for r in results if r["section"] == "grain"]
  notes += [f"load: {r['real_tokens_per_s']:,.0f} real tokens/s; setup "
            f"{r['setup_seconds']:.2f} s" for r in results if r["section"] == "load"]
  notes += [f"balance ({r['case']}, seq_len {r['seq_len']}, {r['batches']} batches): largest "
            f"rank's attention cost / mean {r['random_max_over_mean']:.3f} in epoch order, "
            f"{r['balanced_max_over_mean']:.3f} balanced; ESTIMATE from FLOPs (1.2B model, "
            f"attention {r['attention_flop_share']:.0%} of the FLOPs): the slowest rank's step "
            f"{r['estimated_step_saving']:.1%} shorter" for r in results
            if r["section"] == "balance"]
  notes += [f"repack ({r['case']}): {r['rows']:,} rows, utilization {r['utilization']:.4f}, "
            f"{r['pairs_again']:.1%} of the fixed plan's document pairs share a row again"
            + ("" if "same_rows_as_fixed" not in r else
               f", row lengths {'identical to' if r['same_rows_as_fixed'] else 'UNLIKE'} the "
               f"fixed plan's")
            + ("" if "first_call_seconds" not in r else
               f"; first call (chunks and rows) {r['first_call_seconds']:.3f} s")
            for r in results if r["section"] == "repack"]
  notes += [f"scale ({r['documents']:,} documents, fresh process): plan {r['seconds']:.1f} s "
            f"({r['cpu_seconds']:.1f} s CPU), peak RSS {r['peak_rss'] / 2**20:,.0f} MB = "
            f"{r['peak_bytes_per_doc']:.1f} B/doc with the int32 input "
            f"({r['input_bytes'] / 2**20:,.0f} MB), {r['peak_over_input_bytes_per_doc']:.1f} "
            f"B/doc over it; plan {r['bytes_per_doc']:.1f} B/doc, saved in "
            f"{r['save_seconds']:.1f} s, memory-mapped back in {r['load_seconds'] * 1e3:.1f} ms "
            f"(RSS +{r['load_rss_growth'] / 2**20:.1f} MB)"
            for r in results if r["section"] == "scale"]
  notes += mixture_notes(results)
  return "\n".join(lines + notes)


def _parser() -> argparse.ArgumentParser:
  """The command's flags (its help is the module docstring)."""
  ap = argparse.ArgumentParser(prog="segpack bench packing", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--num-docs", type=errors.at_least(0), default=10_000_000)
  ap.add_argument("--seq-len", type=errors.at_least(2), default=4096)
  ap.add_argument("--mean", type=errors.at_least(1.0, float), default=800.0)
  ap.add_argument("--sigma", type=errors.at_least(0.0, float), default=1.0)
  ap.add_argument("--strategies", default="ffd,bfd")
  ap.add_argument("--repeats", type=errors.at_least(1), default=3)
  ap.add_argument("--extra-tokens", type=errors.at_least(0), default=0,
                  help="virtual slots per document in the plan section (2 = BOS + EOS)")
  ap.add_argument("--grain-docs", type=errors.at_least(0),
                  default=100_000, help="0 skips the Grain section")
  ap.add_argument("--grain-bins", type=errors.at_least(1),
                  default=64, help="Grain's num_packing_bins")
  ap.add_argument("--load-docs", type=errors.at_least(0),
                  default=100_000, help="0 skips the loading section")
  ap.add_argument("--load-batches", type=errors.at_least(1), default=2000)
  ap.add_argument("--batch-size", type=errors.at_least(1), default=8)
  ap.add_argument("--work-dir", default=None, help="where the synthetic shards go (temporary)")
  ap.add_argument("--builtin", default="full", choices=("full", "small", "none"),
                  help="built-in corpus for the builtin section (none skips it)")
  ap.add_argument("--balance-docs", type=errors.at_least(0), default=1_000_000,
                  help="documents of the balance section (0 skips it)")
  ap.add_argument("--balance-seq-len", type=errors.at_least(2), default=32768)
  ap.add_argument("--balance-batch", type=errors.at_least(1),
                  default=64, help="rows per global batch")
  ap.add_argument("--balance-ranks", type=errors.at_least(1), default=8)
  ap.add_argument("--repack-docs", type=errors.at_least(0), default=1_000_000,
                  help="0 skips the repack section")
  ap.add_argument("--scale-docs", type=errors.at_least(0), default=0,
                  help="documents of the scale section (0 skips it), e.g. 100000000: plan time "
                       "and peak RSS of a fresh process")
  ap.add_argument("--mixture-docs", type=errors.at_least(0), default=None,
                  help="documents per source of the mixture section (0 skips it); default "
                       f"{MIXTURE_DOCS:,} when --sections names mixture, else the section is "
                       "skipped")
  ap.add_argument("--mixture-grain-docs", type=errors.at_least(0), default=100_000,
                  help="documents per source for Grain's mix and packer in the mixture section, "
                       "and for segpack beside it (0: segpack alone)")
  ap.add_argument("--mixture-before", action="store_true",
                  help="mixture: after each segpack row, the draw as it was before "
                       "(segpack.bench.mixture_baseline), in a fresh process of its own")
  ap.add_argument("--sections", default=None,
                  help="comma-separated sections to run (plan,grain,load,builtin,balance,repack,"
                       "scale,mixture); default: every section whose size is not 0 (mixture "
                       "only with --mixture-docs)")
  ap.add_argument("--json", action="store_true")
  return ap


# (section, its size flag): a size of 0 skips the section, and `--sections` sets the size of every
# section it does not name to 0.
_SIZE_FLAGS = (("plan", "num_docs"), ("grain", "grain_docs"), ("load", "load_docs"),
               ("balance", "balance_docs"), ("repack", "repack_docs"), ("scale", "scale_docs"),
               ("mixture", "mixture_docs"))


def run_sections(args: argparse.Namespace, strategies: Sequence[str]) -> list[dict[str, Any]]:
  """The results of every section that `args` does not skip, in the table's order."""
  results = []
  if args.num_docs:
    lengths = lognormal_lengths(args.num_docs, mean=args.mean, sigma=args.sigma)
    label = f"lognormal({args.mean:g}, {args.sigma:g})"
    results += bench_plan(lengths, seq_len=args.seq_len, strategies=strategies,
                          repeats=args.repeats, extra_tokens=args.extra_tokens, label=label)
    del lengths
  if args.grain_docs:
    results += bench_grain(lognormal_lengths(args.grain_docs, mean=args.mean, sigma=args.sigma),
                           seq_len=args.seq_len, num_bins=args.grain_bins)
  if args.load_docs:
    results.append(bench_load(lognormal_lengths(args.load_docs, mean=args.mean,
                                                sigma=args.sigma),
                              seq_len=args.seq_len, batch_size=args.batch_size,
                              num_batches=args.load_batches, work_dir=args.work_dir,
                              strategy=strategies[0]))
  if args.builtin != "none":
    results += bench_builtin(args.builtin, strategies=strategies, seq_len=args.seq_len,
                             repeats=args.repeats)
  if args.balance_docs:
    results.append(bench_balance(
        lognormal_lengths(args.balance_docs, mean=args.mean, sigma=args.sigma, seed=1),
        seq_len=args.balance_seq_len, batch_rows=args.balance_batch,
        num_ranks=args.balance_ranks))
  if args.repack_docs:
    results += bench_repack(
        lognormal_lengths(args.repack_docs, mean=args.mean, sigma=args.sigma, seed=2),
        seq_len=args.seq_len, repeats=args.repeats)
  if args.scale_docs:
    results.append(bench_scale(args.scale_docs, seq_len=args.seq_len, work_dir=args.work_dir,
                               mean=args.mean, sigma=args.sigma))
  if args.mixture_docs:
    results += bench_mixture(args.mixture_docs, grain_docs=args.mixture_grain_docs,
                             sigma=args.sigma, seq_len=args.seq_len, num_bins=args.grain_bins,
                             before=args.mixture_before)
  return results


@errors.command("segpack bench packing")
def main(argv: Sequence[str] | None = None) -> int:
  """Runs the sections that the flags select; prints the table (or JSON with `--json`)."""
  args = _parser().parse_args(argv)
  strategies = [s for s in args.strategies.split(",") if s]
  for s in strategies:
    try:
      packing.planner.check_strategy(s)
    except ValueError as e:
      raise errors.UsageError(f"--strategies {args.strategies!r}: {e}") from None
  wanted = None if args.sections is None else set(args.sections.split(","))
  known = {name for name, _ in _SIZE_FLAGS} | {"builtin"}
  if wanted is not None and not wanted <= known:
    raise errors.UsageError(f"--sections {args.sections!r}: unknown {sorted(wanted - known)}; "
                            f"the sections are {sorted(known)}")
  if args.mixture_docs is None:
    args.mixture_docs = MIXTURE_DOCS if wanted is not None and "mixture" in wanted else 0
  for name, flag in _SIZE_FLAGS:
    if wanted is not None and name not in wanted:
      setattr(args, flag, 0)
  if wanted is not None and "builtin" not in wanted:
    args.builtin = "none"
  results = run_sections(args, strategies)
  results_meta = {"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "load_average": os.getloadavg(), "cpus": os.cpu_count()}
  if args.json:
    print(json.dumps({"results": results, **results_meta}, indent=1))
  else:
    print(format_table(results))
    print(f"max RSS {results_meta['max_rss_mb']:.0f} MB; load average "
          f"{results_meta['load_average'][0]:.1f} on {results_meta['cpus']} CPUs (wall seconds "
          f"are inflated when it exceeds the CPU count; cpu_seconds much less so)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""`segpack stats`: packing statistics of a data set.

Examples:
  segpack stats --data DIR --seq-len 4096 --strategy ffd
  segpack stats --data builtin --compare            # the built-in corpus
  segpack stats --data lengths.npy --compare --json
  segpack stats --data "web=data/web:0.7,code=data/code:0.3" --seq-len 4096

`--data` is a shard dataset directory, a `.npy` file of document lengths, or `builtin` /
`builtin:small` for the built-in corpus (built on first use). A mixture of shard dataset
directories (`name=path:weight,...`, read by `segpack.data.mixture.parse_data`, the rule of the
trainer's `data.train` too: an existing path is one dataset) prints, per source, its documents
and tokens, its weight (its target share of the tokens), the target and the realized tokens and
share of mixture epoch 0's draw and how often its documents repeat, then the plan of the whole
draw.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from segpack import packing
from segpack import errors
from segpack.data import epoch_plans
from segpack.data import mixture as mixture_lib
from segpack.data.options import PipelineConfigError, SpecialTokens
from segpack.errors import UserError
from segpack.shards import ShardSource
from segpack.text import corpus

COMPARE_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
BUILTIN_SPELLINGS = ("builtin", "builtin:full", "builtin:small")


class DataArgumentError(UserError, ValueError):
  """`--data` names nothing this CLI can read; the message echoes the value."""


def load_lengths(data: str) -> tuple[np.ndarray, str, str | None]:
  """Document lengths of `data`, a fingerprint for the plan cache and the shard directory.

  Args:
    data: a shard dataset directory, a `.npy` file of lengths, or `builtin[:full|small]`.

  Returns:
    `(lengths, fingerprint, shard directory or None)`.
  """
  if data in BUILTIN_SPELLINGS:  # only these spell the corpus
    size = data.partition(":")[2] or "full"
    data = os.fspath(corpus.ensure_builtin(size=size).train_dir)
  if data.endswith(".npy") and os.path.isfile(data):
    try:
      lengths = np.load(data, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
      raise DataArgumentError(f"--data {data!r} is not a readable .npy file of lengths: {e}") from e
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer) or (lengths < 0).any():
      raise DataArgumentError(
          f"--data {data!r} must hold non-negative integer lengths [N], got dtype {lengths.dtype} "
          f"and shape {lengths.shape}")
    return lengths, packing.cache.lengths_fingerprint(lengths), None
  if not os.path.isdir(data):
    raise DataArgumentError(
        f"--data must be a shard dataset directory, a .npy file of lengths or 'builtin', got "
        f"{data!r}")
  source = ShardSource(data)
  return np.asarray(source.lengths), source.fingerprint, data


def summarize(p: packing.Plan, *, seconds: float | None = None) -> dict[str, Any]:
  """The statistics the CLI prints for one plan."""
  s = p.stats
  out = {
      "strategy": p.strategy, "seq_len": p.seq_len, "documents": s["documents"],
      "rows": p.num_rows, "lower_bound": s["lower_bound"],
      # Slot-equivalent rows over the bound: rows / lower bound for the packed strategies.
      "slots_over_lower_bound": s["slots"] / (p.seq_len * s["lower_bound"]),
      "tokens": s["tokens"], "slots": s["slots"], "utilization": s["utilization"],
      "segments_per_row_mean": s["segments_per_row_mean"],
      "segments_per_row_max": s["segments_per_row_max"],
      "split": s["split"], "truncated": s["truncated"], "dropped": s["dropped"],
      "dropped_tokens": s["dropped_tokens"], "plan_bytes_per_document":
          p.nbytes / max(1, s["documents"]),
  }
  if seconds is not None:
    out["plan_seconds"] = seconds
  return out


def format_summary(row: dict[str, Any]) -> str:
  lines = [f"strategy {row['strategy']}, seq_len {row['seq_len']}"]
  lines += [
      f"  documents           {row['documents']:>14,}",
      f"  rows                {row['rows']:>14,}",
      f"  lower bound         {row['lower_bound']:>14,}   ceil(tokens / seq_len)",
      f"  slots / bound slots {row['slots_over_lower_bound']:>14.6f}   "
      f"rows / lower bound when packed",
      f"  tokens (slots used) {row['tokens']:>14,}   BOS/EOS and overlap included",
      f"  slots               {row['slots']:>14,}",
      f"  utilization         {100 * row['utilization']:>13.3f}%",
      f"  segments per row    {row['segments_per_row_mean']:>14.2f}   mean"
      f" (max {row['segments_per_row_max']})",
      f"  split documents     {row['split']:>14,}",
      f"  truncated documents {row['truncated']:>14,}",
      f"  dropped documents   {row['dropped']:>14,}   ({row['dropped_tokens']:,} slots)",
      f"  plan size           {row['plan_bytes_per_document']:>14.1f}   bytes per document",
  ]
  if "plan_seconds" in row:
    lines.append(f"  planning time       {row['plan_seconds']:>14.3f}   s")
  return "\n".join(lines)


def parse_mixture(data: str, *,
                  tokens_per_epoch: int | None) -> mixture_lib.Mixture | None:
  """The mixture `data` spells, or None when `data` is one dataset: `builtin[:full|:small]`, or
  what `segpack.data.mixture.parse_data` (the trainer's `data.train` rule too) reads as one path.

  Raises:
    DataArgumentError: an entry that cannot be read (a weight that is not a number, weights on
      some entries only, a spelling that reads two ways), naming it.
  """
  if data in BUILTIN_SPELLINGS:
    return None
  try:
    return mixture_lib.parse_data(data, tokens_per_epoch=tokens_per_epoch)
  except PipelineConfigError as e:
    raise DataArgumentError(f"--data {data!r}: {e}") from e


def mixture_stats(mixture: mixture_lib.Mixture, *, seed: int, options: packing.PlanOptions,
                  special: SpecialTokens) -> dict[str, Any]:
  """Per-source figures of mixture epoch 0's draw and the summary of its whole plan.

  Epoch 0 is drawn and planned by `segpack.data.epoch_plans.MixturePlanner`, as
  `pack_dataset(Mixture(...))` plans it; the planning time includes the draw.

  Args:
    mixture: the sources (opened and checked here, `MixtureDraws`).
    seed: the draw's seed (`pack_dataset`'s `seed`).
    options: the packing settings of the drawn documents.
    special: BOS/EOS insertion (`--add-bos`, `--add-eos`): every document's `extra_tokens`.
  """
  draws = mixture_lib.MixtureDraws(mixture, seed=seed, fn="--data")
  planner = epoch_plans.MixturePlanner(draws=draws, options=options, special=special,
                                       loss_mask=False)
  t0 = time.perf_counter()
  draw, p = planner.plan(0)
  plan_row = summarize(p, seconds=time.perf_counter() - t0)
  realized = draw.tokens.sum()
  sources = [{
      "name": name, "documents": int(lengths.size), "tokens": int(lengths.sum()),
      "weight": float(draws.weights[i]), "target_tokens": float(draw.targets[i]),
      "realized_tokens": int(draw.tokens[i]),
      "realized_share": float(draw.tokens[i] / realized),
      "drawn_documents": int(np.sum(draw.documents.parent_index == i)),
      "min_repeats": int(draw.min_repeats[i]), "max_repeats": int(draw.max_repeats[i]),
  } for i, (name, lengths) in enumerate(zip(draws.names, draws.lengths))]
  return {"epoch": 0, "seed": seed, "tokens_per_epoch": draws.tokens_per_epoch,
          "sources": sources, "plan": plan_row}


def format_mixture(stats: dict[str, Any]) -> str:
  """The per-source table of `mixture_stats`, then its plan's summary."""
  lines = [f"mixture of {len(stats['sources'])} sources: epoch {stats['epoch']}'s draw (seed "
           f"{stats['seed']}), {stats['tokens_per_epoch']:,} tokens per epoch",
           f"  {'source':<12}{'documents':>12}{'tokens':>15}{'weight':>9}{'target tokens':>16}"
           f"{'realized tokens':>17}{'realized share':>16}{'repeats':>10}"]
  for r in stats["sources"]:
    repeats = f"{r['min_repeats']}-{r['max_repeats']}"
    lines.append(f"  {r['name']:<12}{r['documents']:>12,}{r['tokens']:>15,}{r['weight']:>9.4f}"
                 f"{r['target_tokens']:>16,.1f}{r['realized_tokens']:>17,}"
                 f"{r['realized_share']:>16.6f}{repeats:>10}")
  lines.append("the whole draw, planned:")
  return "\n".join(lines) + "\n" + format_summary(stats["plan"])


def compare(lengths: np.ndarray, *, options: packing.PlanOptions, extra_tokens: int,
            strategies: Sequence[str], seq_lens: Sequence[int]) -> list[dict[str, Any]]:
  """Plans every strategy at every seq_len (the other settings `options`'); returns one summary
  per pair."""
  rows = []
  for seq_len in seq_lens:
    for strategy in strategies:
      t0 = time.perf_counter()
      p = _plan(lengths, dataclasses.replace(options, seq_len=seq_len, strategy=strategy),
                extra_tokens=extra_tokens)
      rows.append(summarize(p, seconds=time.perf_counter() - t0))
  return rows


def _plan(lengths: np.ndarray, options: packing.PlanOptions, *, extra_tokens: int) -> packing.Plan:
  """`packing.plan` of `lengths` with `options` (which set no segment cap here)."""
  return packing.plan(lengths, options.seq_len, strategy=options.strategy,
                      long_docs=options.long_docs, extra_tokens=extra_tokens,
                      batch_size=options.batch_size, pad_multiple=options.pad_multiple)


def format_compare(rows: list[dict[str, Any]]) -> str:
  """Tables strategy x seq_len of utilization, rows over the lower bound, segments per row."""
  seq_lens = sorted({r["seq_len"] for r in rows})
  strategies = list(dict.fromkeys(r["strategy"] for r in rows))
  cell = {(r["strategy"], r["seq_len"]): r for r in rows}
  out = []
  for title, key, fmt in (("utilization (real tokens / slots)", "utilization",
                           lambda v: f"{100 * v:.2f}%"),
                          ("slots / (seq_len x ceil(tokens / seq_len)): rows over the lower bound",
                           "slots_over_lower_bound",
                           lambda v: f"{v:.4f}"),
                          ("segments per row (mean)", "segments_per_row_mean",
                           lambda v: f"{v:.2f}"),
                          ("split documents", "split", lambda v: f"{v:,}")):
    out.append(title)
    out.append(f"  {'strategy':<11}" + "".join(f"{s:>11}" for s in seq_lens))
    for strategy in strategies:
      out.append(f"  {strategy:<11}" + "".join(
          f"{fmt(cell[strategy, s][key]):>11}" for s in seq_lens))
    out.append("")
  return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="segpack stats", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--data", required=True,
                  help="shard dataset directory, .npy file of lengths, builtin[:small], or a "
                       "mixture of dataset directories 'name=path:weight,...'")
  ap.add_argument("--tokens-per-epoch", type=int, default=None,
                  help="a mixture's tokens per epoch (default: all tokens of its sources)")
  ap.add_argument("--seed", type=int, default=0, help="a mixture's draw seed")
  ap.add_argument("--seq-len", type=int, default=4096)
  ap.add_argument("--strategy", default="ffd", help=f"one of {sorted(packing.STRATEGIES)}")
  ap.add_argument("--long-docs", default="split", help="split or truncate")
  ap.add_argument("--min-len", type=int, default=0)
  ap.add_argument("--overlap", type=int, default=0)
  ap.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--add-eos", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--batch-size", type=int, default=8, help="sorted_pad batch rows")
  ap.add_argument("--pad-multiple", type=int, default=128, help="sorted_pad batch granularity")
  ap.add_argument("--compare", action="store_true",
                  help="table of every strategy x seq_len (--seq-lens)")
  ap.add_argument("--seq-lens", default=",".join(map(str, COMPARE_SEQ_LENS)),
                  help="comma-separated seq_lens for --compare")
  ap.add_argument("--save-plan", action="store_true",
                  help="also cache the plan in DATA/plans (shard directories only)")
  ap.add_argument("--json", action="store_true", help="print JSON instead of text")
  return ap


# Planning memory grows with seq_len (row bookkeeping per slot count): the largest row accepted.
MAX_SEQ_LEN = 1 << 22


def _seq_len(flag: str, text: str) -> int:
  """A `--seq-len(s)` value: an int in [2, MAX_SEQ_LEN], else a DataArgumentError naming it."""
  try:
    value = int(text)
  except ValueError as e:
    raise DataArgumentError(f"{flag}: {text!r} is not an integer number of slots") from e
  if not 2 <= value <= MAX_SEQ_LEN:
    raise DataArgumentError(f"{flag} must be in [2, {MAX_SEQ_LEN}] (planning memory grows with "
                            f"it), got {value}")
  return value


@errors.command("segpack stats")
def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  extra_tokens = int(args.add_bos) + int(args.add_eos)
  try:
    _seq_len("--seq-len", str(args.seq_len))
    packing.planner.check_strategy(args.strategy)
    if args.seed < 0:
      raise DataArgumentError(f"--seed must be an int >= 0 (a draw seed), got {args.seed}")
    if args.tokens_per_epoch is not None and args.tokens_per_epoch <= 0:
      raise DataArgumentError(
          f"--tokens-per-epoch must be a positive number of tokens, got {args.tokens_per_epoch}")
    mixture = parse_mixture(args.data, tokens_per_epoch=args.tokens_per_epoch)
    if mixture is not None:
      return _main_mixture(args, mixture)
    if args.tokens_per_epoch is not None:
      raise DataArgumentError(
          f"--tokens-per-epoch={args.tokens_per_epoch} applies to a mixture "
          f"('name=path:weight,...'), got one dataset --data {args.data!r}")
    lengths, key, directory = load_lengths(args.data)
    if args.compare:
      seq_lens = [_seq_len("--seq-lens", s) for s in args.seq_lens.split(",") if s]
      rows = compare(lengths, options=_options(args, seq_len=(seq_lens or [args.seq_len])[0]),
                     extra_tokens=extra_tokens, strategies=list(packing.STRATEGIES),
                     seq_lens=seq_lens)
      print(json.dumps(rows, indent=1) if args.json else format_compare(rows))
      return 0
    options = _options(args, seq_len=args.seq_len)
    t0 = time.perf_counter()
    if args.save_plan and directory is not None:
      p = options.load_or_plan(lengths, extra_tokens=extra_tokens, key=key,
                               cache_dir=os.path.join(directory, "plans"))
    else:
      p = _plan(lengths, options, extra_tokens=extra_tokens)
    row = summarize(p, seconds=time.perf_counter() - t0)
  except (ValueError, OSError, EOFError) as e:  # bad arguments, unreadable or damaged files
    if not (errors.is_user_error(e) or isinstance(e, EOFError)):
      raise  # a bug: `errors.command` prints its traceback and asks to report it
    print(f"segpack stats: error: {errors.one_line(e)}", file=sys.stderr)
    return 2
  print(json.dumps(row, indent=1) if args.json else format_summary(row))
  return 0


def _options(args: argparse.Namespace, *, seq_len: int) -> packing.PlanOptions:
  """The packing settings the flags spell, with `seq_len` slots per row."""
  return packing.PlanOptions(
      seq_len=seq_len, strategy=args.strategy, batch_size=args.batch_size,
      pad_multiple=args.pad_multiple,
      long_docs=packing.LongDocs(mode=args.long_docs, min_len=args.min_len,
                                 overlap=args.overlap))


def _main_mixture(args: argparse.Namespace, mixture: mixture_lib.Mixture) -> int:
  """`main` for a mixture `--data`: prints `mixture_stats` (errors raise ValueError)."""
  for flag, on in (("--compare", args.compare), ("--save-plan", args.save_plan)):
    if on:
      raise DataArgumentError(
          f"{flag} applies to one dataset; a mixture draws and plans every epoch anew, got "
          f"--data {args.data!r}")
  stats = mixture_stats(mixture, seed=args.seed, options=_options(args, seq_len=args.seq_len),
                        special=SpecialTokens(add_bos=args.add_bos, add_eos=args.add_eos))
  print(json.dumps(stats, indent=1) if args.json else format_mixture(stats))
  return 0


if __name__ == "__main__":
  sys.exit(main())

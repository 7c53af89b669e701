"""The `mixture` section of `segpack bench packing`: token shares and speed of a weighted mixture.

Three in-memory sources of lognormal documents (means `MIXTURE_MEANS`, one sigma) mixed with the
weights `MIXTURE_WEIGHTS`. Document `d` of source `i` is `lengths[d]` copies of the token `i + 1`,
so the tokens of a packed row say which source they came from.

- segpack (`mixture_child`, in a fresh process, as the `scale` section measures): one mixture
  epoch drawn (`MixtureDraws.draw(0)`, the weights are shares of the tokens, every token of the
  sources drawn once on average) and planned (`packing.plan(..., strategy="ffd",
  extra_tokens=2)`): seconds of each, the token share of each source, rows, utilization and
  the process's peak RSS (`ru_maxrss`) per document.
- Grain (`bench_mixture_grain`, in this process): `grain.MapDataset.mix(sources, weights)` (the
  weights are shares of the documents), documents truncated to seq_len (Grain's packers refuse
  longer ones), then `grain.experimental.FirstFitPackIterDataset`, read for one pass of the mix
  (or until it has given as many tokens as the sources hold): the token share of each source in
  the packed rows, rows, utilization and tokens/s.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from typing import Any

import grain
import grain.experimental as gexp
import numpy as np

from segpack import packing
from segpack.bench.mixture_baseline import draw_before
from segpack.bench.packing_sections import lognormal_lengths
from segpack.data.mixture import Mixture, MixtureDraws, MixtureSource

__all__ = ["MIXTURE_MEANS", "MIXTURE_WEIGHTS", "SyntheticSource", "bench_mixture",
           "bench_mixture_grain", "mixture_child", "mixture_notes", "mixture_sources"]

MIXTURE_MEANS = (300.0, 800.0, 3000.0)
MIXTURE_WEIGHTS = (0.5, 0.3, 0.2)


class SyntheticSource:
  """A random-access source in memory: document `d` is `lengths[d]` copies of `value` (int32).

  Example: `SyntheticSource(np.array([2, 1]), value=3)[0]` is `[3, 3]`.
  """

  def __init__(self, lengths: np.ndarray, *, value: int):
    self.lengths = np.asarray(lengths, dtype=np.int64)
    self.value = int(value)

  def __len__(self) -> int:
    return int(self.lengths.size)

  def __getitem__(self, index: int) -> np.ndarray:
    return np.full(int(self.lengths[index]), self.value, dtype=np.int32)


def mixture_sources(num_docs: int, *, sigma: float, seed: int = 3) -> list[SyntheticSource]:
  """The three sources: `num_docs` lognormal lengths each (means `MIXTURE_MEANS`), source `i`'s
  tokens all `i + 1`."""
  return [SyntheticSource(lognormal_lengths(num_docs, mean=mean, sigma=sigma, seed=seed + i),
                          value=i + 1) for i, mean in enumerate(MIXTURE_MEANS)]


def _rss_bytes() -> int:
  """This process's resident set size now (Linux `/proc/self/statm`)."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
  """This process's peak resident set size since it started or since `_reset_peak`."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
  """Starts a new peak RSS from the current RSS (Linux: `5` into `/proc/self/clear_refs`);
  False where the system cannot."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    return False
  return True


def mixture_child(num_docs: int, sigma: float, seq_len: int,
                  before: bool = False) -> dict[str, Any]:
  """Draws and plans mixture epoch 0 of `mixture_sources(num_docs)` in this (fresh) process;
  `before`: drawn as before (`segpack.bench.mixture_baseline.draw_before`).

  Returns:
    seconds (draw, plan, CPU), the realized tokens and share per source, rows, utilization, the
    plan's bytes, the RSS once the sources exist (`input_rss`) and after the draw, the peak RSS
    of the draw and of the plan (each from the RSS it started at; `peaks_apart` False where the
    peak cannot be reset, then both are the process's peak) and the process's peak.
  """
  sources = mixture_sources(num_docs, sigma=sigma)
  mixture = Mixture(sources=tuple(
      MixtureSource(name=f"mean {mean:g}", source=s, weight=w)
      for mean, s, w in zip(MIXTURE_MEANS, sources, MIXTURE_WEIGHTS)))
  draws = MixtureDraws(mixture, seed=0, fn="bench mixture")
  input_rss, start_peak = _rss_bytes(), _peak_bytes()
  apart = _reset_peak()
  c0, t0 = time.process_time(), time.perf_counter()
  draw = draw_before(draws, 0) if before else draws.draw(0)
  t1 = time.perf_counter()
  draw_peak, draw_rss = _peak_bytes(), _rss_bytes()
  apart = apart and _reset_peak()
  t2 = time.perf_counter()
  p = packing.plan(draw.documents.lengths, seq_len, strategy="ffd", extra_tokens=2)
  t3, c3 = time.perf_counter(), time.process_time()
  plan_peak = _peak_bytes()
  s = p.stats
  return {"draw_seconds": t1 - t0, "plan_seconds": t3 - t2, "seconds": (t1 - t0) + (t3 - t2),
          "cpu_seconds": c3 - c0, "drawn_documents": len(draw.documents),
          "source_tokens": [int(n.sum()) for n in draws.lengths],
          "realized_tokens": draw.tokens.tolist(),
          "shares": (draw.tokens / draw.tokens.sum()).tolist(),
          "min_repeats": draw.min_repeats.tolist(), "max_repeats": draw.max_repeats.tolist(),
          "rows": p.num_rows, "lower_bound": s["lower_bound"], "utilization": s["utilization"],
          "dropped": s["dropped"], "tokens": int(draw.tokens.sum()), "plan_bytes": p.nbytes,
          "peak_rss": max(start_peak, draw_peak, plan_peak), "input_rss": input_rss,
          "draw_peak_rss": draw_peak, "draw_rss": draw_rss, "plan_peak_rss": plan_peak,
          "peaks_apart": apart}


def bench_mixture_segpack(num_docs: int, *, sigma: float, seq_len: int,
                          before: bool = False) -> dict[str, Any]:
  """`mixture_child` in a fresh process (its peak RSS is the draw's and the plan's)."""
  code = ("import json, sys; from segpack.bench.packing_mixture import mixture_child; "
          "print(json.dumps(mixture_child(int(sys.argv[1]), float(sys.argv[2]), "
          "int(sys.argv[3]), sys.argv[4] == '1')))")
  out = subprocess.run([sys.executable, "-c", code, str(num_docs), repr(float(sigma)),
                        str(seq_len), str(int(before))], check=True, capture_output=True,
                       text=True)
  r = json.loads(out.stdout.strip().splitlines()[-1])
  n, drawn = 3 * num_docs, r["drawn_documents"]
  return {"section": "mixture", "data": _label(num_docs, sigma),
          "case": "before: draw + ffd" if before else "segpack draw + ffd",
          "documents": n, "seq_len": seq_len, "sigma": sigma, "weights": list(MIXTURE_WEIGHTS),
          **r,
          "tokens_per_s": r["tokens"] / r["seconds"],
          "rows_over_bound": r["rows"] / r["lower_bound"],
          "bytes_per_doc": r["plan_bytes"] / drawn,
          "peak_bytes_per_doc": r["peak_rss"] / n,
          "peak_bytes_per_drawn_doc": r["peak_rss"] / drawn,
          "peak_over_input_bytes_per_drawn_doc": (r["peak_rss"] - r["input_rss"]) / drawn,
          "draw_peak_bytes_per_drawn_doc": (r["draw_peak_rss"] - r["input_rss"]) / drawn,
          "plan_peak_bytes_per_drawn_doc": (r["plan_peak_rss"] - r["draw_rss"]) / drawn,
          "draw_bytes_per_drawn_doc": (r["draw_rss"] - r["input_rss"]) / drawn}


def _label(num_docs: int, sigma: float) -> str:
  return f"lognormal 3 x {num_docs:,}"


def _mix_shares(sources: list[SyntheticSource], seq_len: int) -> tuple[list[float], int]:
  """The token share of each source in one pass of Grain's mix (before truncation), and the
  tokens truncation cuts: Grain's mix over the documents' lengths, read whole."""
  tagged = [grain.MapDataset.source(s.lengths).map(lambda n, i=i: (i, int(n)))
            for i, s in enumerate(sources)]
  picks = np.asarray(list(grain.MapDataset.mix(tagged, weights=list(MIXTURE_WEIGHTS))))
  tokens = np.bincount(picks[:, 0], weights=picks[:, 1], minlength=len(sources))
  cut = int(np.maximum(picks[:, 1] - seq_len, 0).sum())
  return (tokens / tokens.sum()).tolist(), cut


def bench_mixture_grain(num_docs: int, *, sigma: float, seq_len: int,
                        num_bins: int) -> dict[str, Any]:
  """Grain's mix of the three sources (document proportions), then its first-fit packer."""
  sources = mixture_sources(num_docs, sigma=sigma)
  mixed = grain.MapDataset.mix(
      [grain.MapDataset.source(s).map(lambda t: {"tokens": t[:seq_len]}) for s in sources],
      weights=list(MIXTURE_WEIGHTS))
  packed = gexp.FirstFitPackIterDataset(mixed.to_iter_dataset(),
                                        length_struct={"tokens": seq_len},
                                        num_packing_bins=num_bins, shuffle_bins=False)
  source_tokens = sum(int(s.lengths.sum()) for s in sources)
  counts = np.zeros(len(sources) + 1, np.int64)  # token 0 is padding
  rows = 0
  c0, t0 = time.process_time(), time.perf_counter()
  for row in packed:
    counts += np.bincount(row["tokens"], minlength=counts.size)[:counts.size]
    rows += 1
    if counts[1:].sum() >= source_tokens:
      break
  seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
  tokens = int(counts[1:].sum())
  mix_shares, cut = _mix_shares(sources, seq_len)
  lower_bound = -(-tokens // seq_len)
  return {"section": "mixture", "data": _label(num_docs, sigma),
          "case": "Grain mix + FirstFitPack", "documents": 3 * num_docs, "seq_len": seq_len,
          "sigma": sigma, "weights": list(MIXTURE_WEIGHTS), "mixed_documents": len(mixed),
          "seconds": seconds, "cpu_seconds": cpu, "tokens": tokens,
          "source_tokens": [int(s.lengths.sum()) for s in sources],
          "realized_tokens": counts[1:].tolist(), "shares": (counts[1:] / tokens).tolist(),
          "mix_shares": mix_shares, "truncated_tokens": cut, "rows": rows,
          "lower_bound": lower_bound, "rows_over_bound": rows / lower_bound,
          "utilization": tokens / (rows * seq_len), "tokens_per_s": tokens / seconds,
          "num_packing_bins": num_bins}


def bench_mixture(num_docs: int, *, grain_docs: int, sigma: float, seq_len: int,
                  num_bins: int, before: bool = False) -> list[dict[str, Any]]:
  """The section's rows: segpack and Grain on `grain_docs` documents per source (when not 0),
  then segpack on `num_docs` per source; with `before`, each segpack row is followed by the
  draw as it was before (`mixture_baseline`), run right after it."""
  out = []
  sizes = ([grain_docs] if grain_docs else []) + (
      [num_docs] if num_docs != grain_docs or not grain_docs else [])
  for size in sizes:
    out.append(bench_mixture_segpack(size, sigma=sigma, seq_len=seq_len))
    if before:
      out.append(bench_mixture_segpack(size, sigma=sigma, seq_len=seq_len, before=True))
    if size == grain_docs:
      out.append(bench_mixture_grain(size, sigma=sigma, seq_len=seq_len, num_bins=num_bins))
  return out


def _shares(values: list[float]) -> str:
  return " / ".join(f"{v:.4f}" for v in values)


def mixture_notes(results: list[dict[str, Any]]) -> list[str]:
  """One note per `mixture` result for the table."""
  notes = []
  for r in results:
    if r["section"] != "mixture":
      continue
    head = (f"mixture ({r['data']}, sigma {r['sigma']:g}, weights {_shares(r['weights'])}, means "
            f"{' / '.join(f'{m:g}' for m in MIXTURE_MEANS)}), {r['case']}: token shares "
            f"{_shares(r['shares'])}; {r['rows']:,} rows, utilization {r['utilization']:.4f}; ")
    if r["case"].startswith(("segpack", "before")):
      notes.append(
          head + f"{r['drawn_documents']:,} documents drawn, draw {r['draw_seconds']:.3f} s + "
          f"plan {r['plan_seconds']:.3f} s = {r['seconds']:.3f} s ({r['cpu_seconds']:.2f} s "
          f"CPU), {r['tokens_per_s']:,.0f} tokens/s planned; peak RSS of a fresh process "
          f"{r['peak_rss'] / 2**20:,.0f} MB = {r['peak_bytes_per_doc']:.1f} B per source "
          f"document, {r['peak_bytes_per_drawn_doc']:.1f} B per drawn document "
          f"({r['peak_over_input_bytes_per_drawn_doc']:.1f} B over the sources in memory); per "
          f"drawn document: the draw's peak {r['draw_peak_bytes_per_drawn_doc']:.1f} B (it keeps "
          f"{r['draw_bytes_per_drawn_doc']:.1f} B), the plan's peak over it "
          f"{r['plan_peak_bytes_per_drawn_doc']:.1f} B, the plan {r['bytes_per_doc']:.1f} B")
    else:
      notes.append(
          head + f"one pass of the mix, {r['mixed_documents']:,} documents (Grain weights "
          f"documents: token shares of the mix before truncation {_shares(r['mix_shares'])}, "
          f"{r['truncated_tokens']:,} tokens cut at seq_len), {r['seconds']:.1f} s, "
          f"{r['tokens_per_s']:,.0f} tokens/s packed into rows ({r['num_packing_bins']} bins)")
  return notes

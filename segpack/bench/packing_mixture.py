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


def mixture_child(num_docs: int, sigma: float, seq_len: int) -> dict[str, Any]:
  """Draws and plans mixture epoch 0 of `mixture_sources(num_docs)` in this (fresh) process.

  Returns:
    seconds (draw, plan, CPU), the realized tokens and share per source, rows, utilization, the
    plan's bytes, and the RSS once the sources exist (`input_rss`) and at its peak.
  """
  sources = mixture_sources(num_docs, sigma=sigma)
  mixture = Mixture(sources=tuple(
      MixtureSource(name=f"mean {mean:g}", source=s, weight=w)
      for mean, s, w in zip(MIXTURE_MEANS, sources, MIXTURE_WEIGHTS)))
  draws = MixtureDraws(mixture, seed=0, fn="bench mixture")
  input_rss = _rss_bytes()
  c0, t0 = time.process_time(), time.perf_counter()
  draw = draws.draw(0)
  t1 = time.perf_counter()
  p = packing.plan(draw.documents.lengths, seq_len, strategy="ffd", extra_tokens=2)
  t2, c2 = time.perf_counter(), time.process_time()
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  s = p.stats
  return {"draw_seconds": t1 - t0, "plan_seconds": t2 - t1, "seconds": t2 - t0,
          "cpu_seconds": c2 - c0, "drawn_documents": len(draw.documents),
          "source_tokens": [int(n.sum()) for n in draws.lengths],
          "realized_tokens": draw.tokens.tolist(),
          "shares": (draw.tokens / draw.tokens.sum()).tolist(),
          "min_repeats": draw.min_repeats.tolist(), "max_repeats": draw.max_repeats.tolist(),
          "rows": p.num_rows, "lower_bound": s["lower_bound"], "utilization": s["utilization"],
          "dropped": s["dropped"], "tokens": int(draw.tokens.sum()), "plan_bytes": p.nbytes,
          "peak_rss": peak, "input_rss": input_rss}


def bench_mixture_segpack(num_docs: int, *, sigma: float, seq_len: int) -> dict[str, Any]:
  """`mixture_child` in a fresh process (its peak RSS is the draw's and the plan's)."""
  code = ("import json, sys; from segpack.bench.packing_mixture import mixture_child; "
          "print(json.dumps(mixture_child(int(sys.argv[1]), float(sys.argv[2]), "
          "int(sys.argv[3]))))")
  out = subprocess.run([sys.executable, "-c", code, str(num_docs), repr(float(sigma)),
                        str(seq_len)], check=True, capture_output=True, text=True)
  r = json.loads(out.stdout.strip().splitlines()[-1])
  n = 3 * num_docs
  return {"section": "mixture", "data": _label(num_docs, sigma), "case": "segpack draw + ffd",
          "documents": n, "seq_len": seq_len, "sigma": sigma, "weights": list(MIXTURE_WEIGHTS),
          **r,
          "tokens_per_s": r["tokens"] / r["seconds"],
          "rows_over_bound": r["rows"] / r["lower_bound"],
          "bytes_per_doc": r["plan_bytes"] / r["drawn_documents"],
          "peak_bytes_per_doc": r["peak_rss"] / n,
          "peak_bytes_per_drawn_doc": r["peak_rss"] / r["drawn_documents"],
          "peak_over_input_bytes_per_drawn_doc":
              (r["peak_rss"] - r["input_rss"]) / r["drawn_documents"]}


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
                  num_bins: int) -> list[dict[str, Any]]:
  """The section's rows: segpack and Grain on `grain_docs` documents per source (when not 0),
  then segpack on `num_docs` per source."""
  out = []
  if grain_docs:
    out.append(bench_mixture_segpack(grain_docs, sigma=sigma, seq_len=seq_len))
    out.append(bench_mixture_grain(grain_docs, sigma=sigma, seq_len=seq_len, num_bins=num_bins))
  if num_docs != grain_docs or not grain_docs:
    out.append(bench_mixture_segpack(num_docs, sigma=sigma, seq_len=seq_len))
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
    if r["case"].startswith("segpack"):
      notes.append(
          head + f"{r['drawn_documents']:,} documents drawn, draw {r['draw_seconds']:.3f} s + "
          f"plan {r['plan_seconds']:.3f} s = {r['seconds']:.3f} s ({r['cpu_seconds']:.2f} s "
          f"CPU), {r['tokens_per_s']:,.0f} tokens/s planned; peak RSS of a fresh process "
          f"{r['peak_rss'] / 2**20:,.0f} MB = {r['peak_bytes_per_doc']:.1f} B per source "
          f"document, {r['peak_bytes_per_drawn_doc']:.1f} B per drawn document "
          f"({r['peak_over_input_bytes_per_drawn_doc']:.1f} B over the sources in memory)")
    else:
      notes.append(
          head + f"one pass of the mix, {r['mixed_documents']:,} documents (Grain weights "
          f"documents: token shares of the mix before truncation {_shares(r['mix_shares'])}, "
          f"{r['truncated_tokens']:,} tokens cut at seq_len), {r['seconds']:.1f} s, "
          f"{r['tokens_per_s']:,.0f} tokens/s packed into rows ({r['num_packing_bins']} bins)")
  return notes

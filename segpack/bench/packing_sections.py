"""The measuring functions of `segpack bench packing`, one or two per section.

`segpack.bench.packing` (the command) runs them and prints their results; its docstring describes
the sections. The `bench_*` functions return their section's results (dicts with `section`,
`data`, `case` and the section's measures); the others make their inputs (lognormal lengths,
synthetic shards) or help them. `scale_child` runs in the fresh process of the `scale` section.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import grain
import grain.experimental as gexp
import numpy as np

from segpack import packing
from segpack.data import attention_cost
from segpack.data import balance as balance_lib
from segpack.data.options import SpecialTokens
from segpack.packing.permutation import epoch_permutation
from segpack.data.packed import pack_dataset
from segpack.shards import ShardSource, ShardWriter
from segpack.text import corpus


def lognormal_lengths(n: int, *, mean: float = 800.0, sigma: float = 1.0,
                      seed: int = 0) -> np.ndarray:
  """`n` document lengths, lognormal with the given mean, rounded, at least 1."""
  mu = math.log(mean) - sigma * sigma / 2
  lengths = np.round(np.random.default_rng(seed).lognormal(mu, sigma, n)).astype(np.int64)
  return np.maximum(lengths, 1)


def bench_plan(lengths: np.ndarray, *, seq_len: int, strategies: Sequence[str],
               repeats: int, extra_tokens: int, label: str) -> list[dict[str, Any]]:
  """Times `packing.plan` per strategy: best of `repeats` (`first_seconds`: the first run, which
  also pays for faulting in fresh memory)."""
  out = []
  for strategy in strategies:
    walls, cpus = [], []
    p = None
    for _ in range(repeats):
      del p  # free the previous plan before timing the next
      c0, w0 = time.process_time(), time.perf_counter()
      p = packing.plan(lengths, seq_len, strategy=strategy, extra_tokens=extra_tokens)
      walls.append(time.perf_counter() - w0)
      cpus.append(time.process_time() - c0)
    s = p.stats
    out.append({
        "section": "plan", "data": label, "case": strategy, "documents": len(lengths),
        "seq_len": seq_len, "seconds": min(walls), "cpu_seconds": min(cpus),
        "first_seconds": walls[0],
        "docs_per_s": len(lengths) / min(walls), "rows": p.num_rows,
        "lower_bound": s["lower_bound"], "rows_over_bound": s["slots"] / seq_len
                                                          / s["lower_bound"],
        "utilization": s["utilization"], "bytes_per_doc": p.nbytes / len(lengths),
    })
  return out


def _grain_docs(lengths: np.ndarray, seq_len: int) -> list[dict[str, np.ndarray]]:
  return [{"tokens": np.ones(min(int(n), seq_len), np.int32)} for n in lengths]


def bench_grain(lengths: np.ndarray, *, seq_len: int, num_bins: int) -> list[dict[str, Any]]:
  """Grain's first-fit and best-fit packers over `lengths` (clipped to seq_len), vs segpack."""
  docs = _grain_docs(lengths, seq_len)
  tokens = sum(len(d["tokens"]) for d in docs)
  out = []
  for name, cls, ours in (("FirstFitPackIterDataset", gexp.FirstFitPackIterDataset, "ffd"),
                          ("BestFitPackIterDataset", gexp.BestFitPackIterDataset, "bfd")):
    ds = cls(grain.MapDataset.source(docs).to_iter_dataset(), length_struct={"tokens": seq_len},
             num_packing_bins=num_bins, shuffle_bins=False)
    c0, t0 = time.process_time(), time.perf_counter()
    rows = sum(1 for _ in ds)
    grain_s, grain_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    packing.plan(np.minimum(lengths, seq_len), seq_len, strategy=ours)
    ours_s = time.perf_counter() - t0
    out.append({
        "section": "grain", "data": f"lognormal {len(lengths):,}", "case": name,
        "documents": len(lengths), "seq_len": seq_len, "seconds": grain_s,
        "cpu_seconds": grain_cpu,
        "docs_per_s": len(lengths) / grain_s, "rows": rows,
        "lower_bound": -(-tokens // seq_len), "rows_over_bound": rows / -(-tokens // seq_len),
        "num_packing_bins": num_bins, "segpack_strategy": ours, "segpack_seconds": ours_s,
        "segpack_over_grain": grain_s / ours_s,
    })
  return out


def write_synthetic_shards(path: str, lengths: np.ndarray, *, vocab_size: int,
                           seed: int = 0) -> None:
  """A shard dataset of random tokens with the given document lengths."""
  rng = np.random.default_rng(seed)
  pool = rng.integers(3, vocab_size, int(lengths.max()) + 1 << 4, dtype=np.int64)
  with ShardWriter(path, vocab_size=vocab_size, tokenizer_fingerprint="synthetic-bench",
                   shard_tokens=1 << 24, metadata={"bos_id": 1, "eos_id": 2}) as writer:
    for n, off in zip(lengths.tolist(), rng.integers(0, len(pool) // 2, len(lengths)).tolist()):
      writer.write(pool[off:off + n])


def bench_load(lengths: np.ndarray, *, seq_len: int, batch_size: int, num_batches: int,
               work_dir: str | None, strategy: str) -> dict[str, Any]:
  """Tokens/s of `pack_dataset(...).batch(batch_size)` from memory-mapped shards."""
  with tempfile.TemporaryDirectory(dir=work_dir, prefix="segpack-bench-") as tmp:
    data = os.path.join(tmp, "data")
    write_synthetic_shards(data, lengths, vocab_size=32000)
    t0 = time.perf_counter()
    ds = pack_dataset(data, plan=packing.PlanOptions(seq_len=seq_len, strategy=strategy),
                      seed=0, special_tokens=SpecialTokens(bos_id=1, eos_id=2)
                      ).batch(batch_size, drop_remainder=True)
    setup_s = time.perf_counter() - t0
    n = min(num_batches, len(ds))
    ds[0]  # warm up (page cache, first-call costs)
    c0, t0 = time.process_time(), time.perf_counter()
    real = 0
    for i in range(n):
      batch = ds[i]
      real += int(np.count_nonzero(batch["segment_ids"]))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
  slots = n * batch_size * seq_len
  return {"section": "load", "data": f"synthetic shards, {len(lengths):,} docs",
          "case": f"pack_dataset.batch({batch_size})", "documents": len(lengths),
          "seq_len": seq_len, "seconds": seconds, "cpu_seconds": cpu, "batches": n,
          "tokens_per_s": slots / seconds, "real_tokens_per_s": real / seconds,
          "setup_seconds": setup_s, "features": sorted(batch)}


def bench_builtin(size: str, *, strategies: Sequence[str], seq_len: int,
                  repeats: int) -> list[dict[str, Any]]:
  """The packers on the built-in corpus; an empty list (and a note) when unavailable."""
  try:
    built = corpus.ensure_builtin(size=size)
    lengths = np.asarray(ShardSource(built.train_dir).lengths)
  except Exception as e:  # pylint: disable=broad-except
    print(f"note: built-in corpus ({size}) unavailable, skipped: {type(e).__name__}: {e}",
          file=sys.stderr)
    return []
  return bench_plan(lengths, seq_len=seq_len, strategies=strategies, repeats=repeats,
                    extra_tokens=2, label=f"builtin {size}")


# The model the balance estimate assumes: a Llama-like 1B decoder (E 2048, 16 layers, 16 heads of
# 128, about 1.2e9 non-embedding parameters).
BALANCE_MODEL = {"layers": 16, "heads": 16, "head_dim": 128, "params": 1.2e9}


def bench_balance(lengths: np.ndarray, *, seq_len: int, batch_rows: int,
                  num_ranks: int) -> dict[str, Any]:
  """Per-rank attention cost, epoch-permutation order vs balanced, averaged over global batches.

  The step-time estimate is on paper, from FLOPs: a rank's step does `6 * N` dense FLOPs per
  token (forward and backward) and `4 * D * H * L * sum l(l+1)/2` attention FLOPs per row
  forward, times 3 with the backward pass; a step lasts as long as its slowest rank. The saving
  is `1 - max_balanced / max_random` of those per-rank FLOPs, averaged over batches.
  """
  p = packing.plan(lengths, seq_len, strategy="ffd", extra_tokens=2)
  costs = attention_cost.row_attention_cost(p).astype(np.float64)
  rows_per_step = (p.num_rows // batch_rows) * batch_rows
  random_costs_GxB = costs[epoch_permutation(p.num_rows, seed=0, epoch=0)][:rows_per_step]
  random_costs_GxB = random_costs_GxB.reshape(-1, batch_rows)
  perm_GxB = balance_lib.assign_rows(random_costs_GxB, num_ranks=num_ranks)
  balanced_GxB = np.take_along_axis(random_costs_GxB, perm_GxB, axis=1)
  mean_G = random_costs_GxB.sum(axis=1) / num_ranks
  random_max_G = random_costs_GxB.reshape(len(mean_G), num_ranks, -1).sum(axis=2).max(axis=1)
  balanced_max_G = balanced_GxB.reshape(len(mean_G), num_ranks, -1).sum(axis=2).max(axis=1)
  m = BALANCE_MODEL
  attn = 3 * 4 * m["head_dim"] * m["heads"] * m["layers"]  # FLOPs per causal (q, k) pair
  dense = 6 * m["params"] * seq_len * (batch_rows // num_ranks)  # per rank, padding included
  step_random = dense + attn * random_max_G
  step_balanced = dense + attn * balanced_max_G
  attn_share = attn * mean_G / (dense + attn * mean_G)
  return {"section": "balance", "data": f"lognormal {len(lengths):,}",
          "case": f"{num_ranks} ranks x {batch_rows // num_ranks} rows", "seq_len": seq_len,
          "documents": len(lengths), "batches": len(mean_G),
          "random_max_over_mean": float(np.mean(random_max_G / mean_G)),
          "balanced_max_over_mean": float(np.mean(balanced_max_G / mean_G)),
          "attention_flop_share": float(np.mean(attn_share)),
          "estimated_step_saving": float(np.mean(1 - step_balanced / step_random)),
          "model": dict(m)}


def row_pairs(p: packing.Plan) -> np.ndarray:
  """The sorted, unique pairs of distinct documents sharing a row, as `a * num_docs + b`."""
  doc = np.asarray(p.doc, np.int64)
  row = np.repeat(np.arange(p.num_rows), np.diff(np.asarray(p.row_splits, np.int64)))
  big = int(doc.max(initial=0)) + 1
  keys = []
  for offset in range(1, int(np.diff(p.row_splits).max(initial=1))):
    same = row[offset:] == row[:-offset]
    a, b = doc[:-offset][same], doc[offset:][same]
    keys.append(np.minimum(a, b) * big + np.maximum(a, b))
  keys = np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64)
  return keys[keys // big != keys % big]


def bench_repack(lengths: np.ndarray, *, seq_len: int, repeats: int) -> list[dict[str, Any]]:
  """The fixed plan against the plans of `repack="epoch"` (FFD, BOS + EOS).

  Cases: the fixed plan (`packing.plan`); epoch 1 planned from scratch (`packing.plan(...,
  tie_seed=(0, 1))`); and the epochs after the first through `packing.RepackPlanner`, as
  `pack_dataset(repack="epoch")` plans them (the chunks and rows computed once, on its first
  call, then reused; each timed call plans a new epoch). Seconds are the best of `repeats`.
  """
  out, plans = [], {}
  options, extra = packing.PlanOptions(seq_len=seq_len, strategy="ffd"), 2
  repack_planner = options.repack_planner(lengths, extra_tokens=extra, seed=0)
  c0, t0 = time.process_time(), time.perf_counter()
  repack_planner.plan(1)
  first = (time.perf_counter() - t0, time.process_time() - c0)
  epochs = iter(range(2, 2 + max(1, repeats)))
  cases = (("fixed", lambda: options.plan(lengths, extra_tokens=extra)),
           ("repack epoch 1, plan()", lambda: options.plan(lengths, extra_tokens=extra,
                                                          tie_seed=(0, 1))),
           ("repack epoch 2+, RepackPlanner", lambda: repack_planner.plan(next(epochs))))
  for case, make in cases:
    best = best_cpu = math.inf
    for _ in range(max(1, repeats)):
      plans.pop(case, None)
      t0, c0 = time.perf_counter(), time.process_time()
      plans[case] = make()
      best = min(best, time.perf_counter() - t0)
      best_cpu = min(best_cpu, time.process_time() - c0)
    out.append({"section": "repack", "data": f"lognormal {len(lengths):,}", "case": case,
                "documents": len(lengths), "seconds": best, "cpu_seconds": best_cpu,
                "docs_per_s": len(lengths) / best, "rows": plans[case].num_rows,
                "utilization": plans[case].stats["utilization"]})
  out[2].update(first_call_seconds=first[0], first_call_cpu_seconds=first[1])
  fixed_pairs = row_pairs(plans["fixed"])
  for r, case in zip(out, plans):
    if case == "fixed":
      r["pairs_again"] = 1.0
      continue
    again = np.isin(fixed_pairs, row_pairs(plans[case]), assume_unique=True)
    r["pairs_again"] = float(again.mean()) if len(fixed_pairs) else 0.0
    r["same_rows_as_fixed"] = bool(
        np.array_equal(plans[case].row_splits, plans["fixed"].row_splits)
        and np.array_equal(plans[case].length, plans["fixed"].length))
  return out


def write_lognormal_lengths(path: str, n: int, *, mean: float = 800.0, sigma: float = 1.0,
                            seed: int = 0, block: int = 1 << 22) -> None:
  """`lognormal_lengths(n, ...)` as an int32 `.npy` file, written block by block (the same
  values: the generator draws the same stream in blocks)."""
  mu = math.log(mean) - sigma * sigma / 2
  rng = np.random.default_rng(seed)
  out = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(n,))
  for a in range(0, n, block):
    m = min(block, n - a)
    out[a:a + m] = np.maximum(np.round(rng.lognormal(mu, sigma, m)), 1)
  out.flush()
  del out


def _rss_bytes() -> int:
  """This process's resident set size now (Linux `/proc/self/statm`)."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scale_child(lengths_path: str, seq_len: int, plan_dir: str) -> dict[str, Any]:
  """Plans the lengths of `lengths_path` in this (fresh) process, saves the plan, reloads it
  memory-mapped; returns times and RSS (the `scale` section runs it in a subprocess)."""
  lengths = np.load(lengths_path)  # read into memory: the input, counted in `input_rss`
  input_rss = _rss_bytes()
  c0, t0 = time.process_time(), time.perf_counter()
  p = packing.plan(lengths, seq_len, strategy="ffd", extra_tokens=2)
  seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  t0 = time.perf_counter()
  p.save(plan_dir)
  save_s = time.perf_counter() - t0
  nbytes, rows, stats = p.nbytes, p.num_rows, p.stats
  del p
  rss_before_load = _rss_bytes()
  t0 = time.perf_counter()
  q = packing.Plan.load(plan_dir, mmap=True)
  load_s = time.perf_counter() - t0
  mapped = all(isinstance(getattr(q, f), np.memmap) for f in ("row_splits", "doc", "start",
                                                               "length"))
  return {"seconds": seconds, "cpu_seconds": cpu, "peak_rss": peak, "input_rss": input_rss,
          "input_bytes": int(lengths.nbytes), "plan_bytes": nbytes, "rows": rows,
          "lower_bound": stats["lower_bound"], "utilization": stats["utilization"],
          "save_seconds": save_s, "load_seconds": load_s, "load_memory_mapped": mapped,
          "load_rss_growth": _rss_bytes() - rss_before_load}


def bench_scale(num_docs: int, *, seq_len: int, work_dir: str | None, mean: float,
                sigma: float) -> dict[str, Any]:
  """Plan time and peak RSS of one fresh process that loads `num_docs` int32 lognormal lengths
  and plans them (FFD, BOS + EOS), then saves and memory-maps the plan."""
  with tempfile.TemporaryDirectory(dir=work_dir, prefix="segpack-scale-") as tmp:
    path = os.path.join(tmp, "lengths.npy")
    write_lognormal_lengths(path, num_docs, mean=mean, sigma=sigma)
    code = ("import json, sys; from segpack.bench.packing_sections import scale_child; "
            "print(json.dumps(scale_child(sys.argv[1], int(sys.argv[2]), sys.argv[3])))")
    out = subprocess.run([sys.executable, "-c", code, path, str(seq_len),
                          os.path.join(tmp, "plan")], check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
  n = num_docs
  return {"section": "scale", "data": f"lognormal({mean:g}, {sigma:g}) int32", "case": "ffd",
          "documents": n, "seq_len": seq_len, **r, "docs_per_s": n / r["seconds"],
          "rows_over_bound": r["rows"] / r["lower_bound"], "bytes_per_doc": r["plan_bytes"] / n,
          "peak_bytes_per_doc": r["peak_rss"] / n,
          "peak_over_input_bytes_per_doc": (r["peak_rss"] - r["input_rss"]) / n}

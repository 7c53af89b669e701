"""One command for a GPU: attention correctness over the test grid, cuDNN memory, benchmark.

    segpack bench gpu-report [--out gpu_report.json] [--quick] [--platform cpu] [--jobs 4]
                             [--no-bench]            # or python -m segpack.bench.gpu_report

On a CUDA GPU it runs every check of `segpack.bench.gpu_checks` over the grid of the `gpu` tests
(`segpack.bench.gpu_cases`, `tests/attention/test_gpu.py`; `--quick`: a 32-point subset), the cuDNN memory
check at N = 32 (`segpack.bench.gpu_memory`), and the attention benchmark
(`segpack.bench.attention` at its default sizes; `--quick`: S = 4096 and 8192, D = 128), and,
with more than one GPU, the context-parallel step times (`context_parallel`: forward + backward
of Pallas `segment_attention` at S = 32768 over cp = min(8, GPUs rounded down to a power of two)
devices, one packed row each of mean document length 800 and 8000, for every slot order,
`segpack.bench.context_step`; with one GPU or on the CPU "not yet measured"), then writes ONE
JSON file (temporary file, then `os.replace`; rewritten after every group of checks,
with `"complete": false` until the end) holding the device, the versions, the date, every check
record, the benchmark records and a summary, and prints a short table.

Compile counts: one float32 reference per (S, D, heads, causal), one XLA yardstick per dtype on
top, one program per backend: about 430 programs for the full grid. They are compiled ahead in
`--jobs` threads (XLA compiles outside the GIL, without GEMM autotuning) while the checks run in
order on the device.

Exit status: 0 when no check failed (unsupported ones do not count), 1 when one failed (the report
is written all the same), 2 without a GPU unless `--platform cpu` is given. `--platform cpu` runs
a tiny grid on the CPU (Pallas in interpret mode, cuDNN recorded as unsupported) and the
benchmark's tile counts: it proves the command and its JSON, not the numbers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import pathlib
import platform as platform_lib
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jaxlib

import segpack
from segpack.bench import attention as bench
from segpack.bench import attention_context
from segpack.bench import context_step
from segpack.bench import gpu_cases
from segpack.bench import gpu_checks
from segpack.bench import gpu_memory
from segpack import errors
from segpack.files import atomic_write_bytes

CP_SEQ_LEN = 32768
CP_MEANS = (800.0, 8000.0)
CP_MAX_SIZE = 8

_BENCH_ARGS = {
    "full": [],
    "quick": ["--seq-lens", "4096", "8192", "--head-dims", "128"],
    "cpu": ["--seq-lens", "256", "--head-dims", "64", "--rows", "2"],
}


class AheadCompiler:
  """A `gpu_checks.Compile` that compiles submitted programs in threads, ahead of their use.

  `submit` queues a program; calling the compiler with the same key waits for it (re-raising its
  compile error) and compiles anything not submitted. `drop` forgets executables no longer needed.
  """

  def __init__(self, jobs: int):
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs) if jobs > 1 else None
    self._futures: dict[tuple, concurrent.futures.Future] = {}

  def submit(self, key: tuple, fn: Callable[..., Any], args: tuple) -> None:
    if self._pool is not None and key not in self._futures:
      self._futures[key] = self._pool.submit(gpu_checks.compile_now, key, fn, args)

  def __call__(self, key: tuple, fn: Callable[..., Any], args: tuple) -> Any:
    if key not in self._futures:
      future: concurrent.futures.Future = concurrent.futures.Future()
      try:
        future.set_result(gpu_checks.compile_now(key, fn, args))
      except Exception as e:  # pylint: disable=broad-except
        future.set_exception(e)
      self._futures[key] = future
    return self._futures[key].result()

  def drop(self, keys: Sequence[tuple]) -> None:
    for key in keys:
      future = self._futures.pop(key, None)
      if future is not None:
        future.cancel()

  def close(self) -> None:
    self._futures.clear()
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)


def _group_programs(points: list[gpu_cases.GridPoint], case: gpu_cases.Case, *,
                    interpret: bool) -> list[gpu_checks.Program]:
  """The programs one yardstick group needs, in the order it uses them."""
  p0 = points[0]
  programs = [gpu_checks.reference_program(case, causal=p0.causal),
              gpu_checks.compare_program(gpu_checks.Attention("xla", p0.causal), case, p0.dtype)]
  for p in points:
    attn = gpu_checks.backend_attention(p.implementation, case, causal=p.causal,
                                        interpret=interpret)
    programs.append(gpu_checks.compare_program(attn, case, p.dtype))
  return programs


def run_checks(points: list[gpu_cases.GridPoint], *, interpret: bool, jobs: int,
               on_group: Callable[[list[dict[str, Any]]], None] = lambda records: None
               ) -> list[dict[str, Any]]:
  """Every grid point's record, in grid order; `on_group` sees the records after each group."""
  cases: dict[tuple, gpu_cases.Case] = {}
  groups = []
  for _, pts in itertools.groupby(points, key=lambda p: p.group):
    pts = list(pts)
    key = (pts[0].seq_len, pts[0].head_dim, pts[0].heads)
    if key not in cases:
      cases[key] = gpu_cases.case_for(pts[0])
    groups.append((pts, cases[key]))
  compiler = AheadCompiler(jobs)
  programs = [_group_programs(pts, case, interpret=interpret) for pts, case in groups]
  for program in itertools.chain.from_iterable(programs):
    compiler.submit(*program)
  records: list[dict[str, Any]] = []
  try:
    for i, (pts, case) in enumerate(groups):
      p0 = pts[0]
      yard = gpu_checks.make_yardstick(case=case, dtype=p0.dtype, causal=p0.causal,
                                       compiler=compiler)
      for p in pts:
        rec = gpu_checks.check_backend(implementation=p.implementation, case=case, dtype=p.dtype,
                                       causal=p.causal, interpret=interpret, yardstick=yard,
                                       compiler=compiler)
        records.append(rec)
        print(f"[{len(records)}/{len(points)}] {rec['id']}: {rec['status']} "
              f"({rec['seconds']:.1f} s)", file=sys.stderr, flush=True)
      del yard
      later = {prog[0] for prog in itertools.chain.from_iterable(programs[i + 1:])}
      compiler.drop([prog[0] for prog in programs[i] if prog[0] not in later])
      on_group(records)
  finally:
    compiler.close()
  return records


def versions() -> dict[str, Any]:
  """Python, jax, jaxlib, segpack, and the installed CUDA plugin and cuDNN packages (or None)."""
  found: dict[str, dict[str, str]] = {"cuda_plugin": {}, "cudnn": {}}
  for dist in importlib.metadata.distributions():
    name = dist.name or ""
    norm = name.lower().replace("_", "-")
    if norm.startswith("jax-cuda"):
      found["cuda_plugin"][name] = dist.version
    elif norm.startswith("nvidia-cudnn"):
      found["cudnn"][name] = dist.version
  return dict(python=platform_lib.python_version(), jax=jax.__version__,
              jaxlib=jaxlib.__version__, segpack=segpack.__version__,
              cuda_plugin=found["cuda_plugin"] or None, cudnn=found["cudnn"] or None)


def device_info() -> dict[str, Any]:
  """The first device: platform, kind, compute capability, platform version, device count."""
  dev = jax.devices()[0]
  return dict(platform=dev.platform, device_kind=dev.device_kind,
              compute_capability=getattr(dev, "compute_capability", None),
              platform_version=dev.client.platform_version, device_count=jax.device_count())


def run_benchmark(mode: str) -> list[dict[str, Any]]:
  """`segpack.bench.attention`'s records in-process (`mode`: full, quick or cpu)."""
  try:
    return bench.run(bench.parse_args(_BENCH_ARGS[mode]))
  except Exception as e:  # pylint: disable=broad-except
    return [{"error": gpu_checks.describe_error(e)}]


def context_parallel_timing(*, on_gpu: bool) -> dict[str, Any]:
  """Context-parallel step times per slot order with more than one GPU, else not measured."""
  count = jax.device_count()
  if not on_gpu or count < 2:
    return dict(status=context_step.NOT_MEASURED,
                reason=f"context-parallel step times need more than one GPU; this run has "
                       f"{count} {jax.default_backend()} device(s)")
  cp = min(CP_MAX_SIZE, 2 ** int(math.log2(count)))
  records: list[dict[str, Any]] = []
  for mean in CP_MEANS:
    seg = attention_context.packed_rows(CP_SEQ_LEN, num_rows=1, mean=mean, sigma=1.0, seed=0)
    try:
      recs = context_step.time_orders(
          mesh=context_step.context_mesh(cp), segment_ids_BxS=seg,
          heads=attention_context.HEADS, kv_heads=attention_context.KV_HEADS,
          head_dim=attention_context.HEAD_DIM, dtype="bfloat16", implementation="pallas")
    except Exception as e:  # pylint: disable=broad-except
      records.append(dict(mean=mean, error=gpu_checks.describe_error(e)))
      continue
    records.extend(dict(r, mean=mean) for r in recs)
  return dict(status="measured", seq_len=CP_SEQ_LEN, context_size=cp, records=records)


def format_context(section: dict[str, Any] | str) -> str:
  """The context-parallel section: one line per (mean, order), or why it did not run."""
  if not isinstance(section, dict) or section["status"] != "measured":
    reason = section if not isinstance(section, dict) else (
        f"{section['status']} ({section['reason']})")
    return f"context-parallel step times: {reason}"
  lines = [f"context-parallel step times, S={section['seq_len']}, cp={section['context_size']}, "
           f"Pallas, forward + backward:"]
  for r in section["records"]:
    lines.append(f"  mean {r['mean']:>5.0f} " + (
        f"error: {r['error']}" if "error" in r else
        f"{r['balance']:<9} {r['step_ms']:>9.2f} ms  x{r['ratio_to_none']:.3f}  "
        f"(max/mean cost {r['max_over_mean']:.3f})"))
  return "\n".join(lines)


def summarize(records: list[dict[str, Any]]) -> dict[str, int]:
  """Counts of `passed`, `failed` and `unsupported` records."""
  counts = {"passed": 0, "failed": 0, "unsupported": 0}
  for rec in records:
    counts[rec["status"].split(":")[0]] += 1
  return counts


def _jsonable(x: Any) -> Any:
  """Non-finite floats become the strings "nan", "inf", "-inf" (JSON has no such numbers)."""
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  return x


def write_report(path: pathlib.Path, report: dict[str, Any]) -> None:
  """Writes `report` as JSON to `path` atomically (temporary file in its directory, rename)."""
  text = json.dumps(_jsonable(report), indent=1, sort_keys=True, allow_nan=False) + "\n"
  atomic_write_bytes(path, text.encode("utf-8"))


def _over_tolerance(rec: dict[str, Any], t: str) -> float | None:
  """A record's relative error of tensor `t` over its tolerance (<= 1 passes), if it ran."""
  err, tol = rec.get("errors", {}).get(t), rec.get("tolerance", {}).get("error", {}).get(t)
  return None if err is None or tol is None else err / tol


def format_table(report: dict[str, Any]) -> str:
  """Per backend and dtype: counts and the worst error / tolerance per tensor; then failures."""
  head = (f"{'backend':<8} {'dtype':<5} {'passed':>6} {'failed':>6} {'unsupp.':>7}   "
          + " ".join(f"{t + ' e/tol':>10}" for t in gpu_checks.TENSORS))
  lines = [head, "-" * len(head)]
  checks = report["checks"]
  for impl, dtype in sorted({(r["implementation"], r["dtype"]) for r in checks}):
    recs = [r for r in checks if (r["implementation"], r["dtype"]) == (impl, dtype)]
    counts = summarize(recs)
    worst = []
    for t in gpu_checks.TENSORS:
      ratios = [v for v in (_over_tolerance(r, t) for r in recs) if v is not None]
      worst.append(f"{max(ratios):>10.2f}" if ratios else f"{'-':>10}")
    lines.append(f"{impl:<8} {gpu_cases.SHORT_DTYPES[dtype]:<5} {counts['passed']:>6} "
                 f"{counts['failed']:>6} {counts['unsupported']:>7}   " + " ".join(worst))
  mem = report["cudnn_memory"]
  lines.append(f"cuDNN memory at N={mem['cudnn_segment_bound']}: {mem['status']}"
               + (f"; temp {mem['temp_bytes']:,} bytes, model {mem['model_bytes']:,.0f}"
                  if "temp_bytes" in mem else ""))
  for rec in checks + [mem]:
    if rec["status"] == "failed":
      lines.append(f"FAILED {rec.get('id', rec.get('check'))}: {'; '.join(rec['failures'])}")
  s = report["summary"]
  lines.append(f"{s['passed']} passed, {s['failed']} failed, {s['unsupported']} unsupported "
               f"({report['seconds']:.0f} s)")
  return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(prog="segpack bench gpu-report", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default="gpu_report.json", help="the JSON report (written atomically)")
  ap.add_argument("--quick", action="store_true", help="a small subset of the grid")
  ap.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                  help="cpu: a tiny grid on the CPU that checks this command, not the numbers")
  ap.add_argument("--jobs", type=errors.at_least(1), default=min(4, os.cpu_count() or 1),
                  help="threads compiling programs ahead (1: compile when needed)")
  ap.add_argument("--no-bench", action="store_true",
                  help="skip the attention benchmark and the context-parallel step times")
  args = ap.parse_args(argv)
  if args.jobs < 1:
    ap.error(f"--jobs must be >= 1, got {args.jobs}")
  if args.platform == "cpu" and not args.quick:
    ap.error("--platform cpu needs --quick (the full grid, Pallas interpreted, would take hours)")
  return args


def _platform_error(requested: str) -> str | None:
  """Why the run cannot go on (None if it can)."""
  if requested == "cpu":
    jax.config.update("jax_platforms", "cpu")  # no effect once backends exist; checked below
    backend = jax.default_backend()
    return None if backend == "cpu" else (
        f"gpu_report: --platform cpu, but JAX already runs on {backend!r}")
  reason = gpu_checks.cuda_skip_reason()
  if reason:
    return (f"gpu_report: {reason}; pass --platform cpu for a CPU run of the command (Pallas "
            "interpreted, cuDNN unsupported; not the numbers)")
  return None


@errors.command("segpack bench gpu-report")
def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  error = _platform_error(args.platform)
  if error:
    print(error, file=sys.stderr)
    return 2
  t0 = time.perf_counter()
  on_cpu = args.platform == "cpu"
  mode = "cpu" if on_cpu else "quick" if args.quick else "full"
  axes = {"cpu": gpu_cases.CPU_GRID, "quick": gpu_cases.QUICK_GRID,
          "full": gpu_cases.FULL_GRID}[mode]
  out = pathlib.Path(args.out)
  report: dict[str, Any] = dict(
      command=" ".join(["segpack bench gpu-report",
                        *(sys.argv[1:] if argv is None else argv)]),
      mode=mode, device=device_info(), versions=versions(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      tolerance_rule=dict(error_factor=gpu_checks.ERROR_FACTOR,
                          worst_slot_factor=gpu_checks.WORST_SLOT_FACTOR,
                          worst_slot_floor_factor=gpu_checks.WORST_SLOT_FLOOR_FACTOR,
                          floors=gpu_checks.ERROR_FLOORS),
      complete=False, checks=[], cudnn_memory=None, benchmark=None, context_parallel=None)

  def save(records: list[dict[str, Any]]) -> None:
    report.update(checks=records, summary=summarize(records),
                  seconds=time.perf_counter() - t0)
    write_report(out, report)

  records = run_checks(gpu_cases.grid(axes), interpret=on_cpu, jobs=args.jobs, on_group=save)
  report["cudnn_memory"] = gpu_memory.cudnn_memory_check()
  save(records)
  report["benchmark"] = "skipped (--no-bench)" if args.no_bench else run_benchmark(mode)
  report["context_parallel"] = ("skipped (--no-bench)" if args.no_bench
                                else context_parallel_timing(on_gpu=not on_cpu))
  report.update(complete=True, summary=summarize(records + [report["cudnn_memory"]]),
                seconds=time.perf_counter() - t0)
  write_report(out, report)
  print(format_table(report))
  if isinstance(report["benchmark"], list) and report["benchmark"] and (
      "seq_len" in report["benchmark"][0]):
    print()
    print(bench.format_table(report["benchmark"]))
  print(format_context(report["context_parallel"]))
  print(f"\nreport: {out}")
  return 1 if report["summary"]["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())

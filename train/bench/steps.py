"""The trainer's own step, timed: `python -m train.bench steps --config configs/packed.py:gpu`.

Times the jitted step that `python -m train.main` runs (`train.setup.setup`: the same data
pipeline, model, shardings and optimizer) on any config, and can profile a few steps.

Algorithm:
  1. Load `--config FILE[:VARIANT]`; with `--hf-config DIR`, take the architecture of the Hugging
     Face `DIR/config.json` (no weights: the model starts from random initialisation); then apply
     the `--set KEY=VALUE` overrides (`train.batch_size=4`).
  2. Check the config (`preflight`, timed apart), set the run up in a fresh `--workdir`, run
     `--warmup` steps (the first compiles) and wait.
  3. Time `--steps` steps, waiting only after the last; sum their real tokens, slots and causal
     within-document (query, key) pairs from the step's own metrics.
  4. Model FLOPs (`train/model/flops.py`: `6 N` per real token plus `12 L H D` per pair) over the time
     give MFU against the devices' bf16 peak; the allocator's peak is the device memory.
  5. With `--profile-steps N`, trace N more steps (`jax.profiler.trace`, a Perfetto trace under
     WORKDIR/profile): device kernel time per step, split into attention, matmul, fusion,
     copy and other kernels (`KERNEL_GROUPS`), and the kernels that took the most time; the
     setup is then profiled too (`cProfile`): segpack's and the trainer's functions by
     cumulative time, and any library's by its own time (a compile, a wait on the device).

Example: 20 steps of 4 rows x 8192 slots at 95% slot utilization are 622,592 real tokens; with
N = 1.24e9 that is 4.6e15 model FLOPs (plus attention): in 12 s, 385 TFLOP/s, 39% of 989.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import difflib
import gzip
import importlib.util
import json
import os
import pathlib
import pstats
import tempfile
import time
from typing import Any, Sequence

import jax
import ml_collections

import segpack
from segpack import errors
import train
from train import data as data_lib
from train.model import flops as flops_lib
from train.model import config as model_config
from train import sharding as sharding_lib
from train import setup as setup_lib
from train.hf import config as hf_config


def load_config(spec: str) -> ml_collections.ConfigDict:
  """`FILE[:VARIANT]` (as `--config=` of `python -m train.main`) -> the locked config."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise errors.ArgumentError(f"--config: no config file {path!r}")
  module_spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or None)


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
  """`KEY=VALUE` pairs (dotted keys; values as Python literals, else strings), in place."""
  for item in overrides:
    key, sep, text = item.partition("=")
    if not sep:
      raise errors.ArgumentError(f"--set: expected KEY=VALUE, got {item!r}")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    node, parts = config, key.split(".")
    for depth, part in enumerate(parts):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        where = ".".join(parts[:depth]) or "the config"
        known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        near = difflib.get_close_matches(part, known, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else f"; its keys: {', '.join(known)}"
        raise errors.ArgumentError(f"--set {item!r}: {where} has no key {part!r}{hint}")
      if depth < len(parts) - 1:
        node = node[part]
    try:
      node[parts[-1]] = value
    except (TypeError, ValueError) as e:
      raise errors.ArgumentError(f"--set {item!r}: {errors.one_line(e)}") from None


# Kernel groups of a profile, the first pattern that matches a kernel's name (case-insensitive).
KERNEL_GROUPS = (("attention", ("segment_flash", "mha", "fmha", "cudnn", "attention")),
                 ("matmul", ("nvjet", "gemm", "cutlass", "cublas", "dot")),
                 ("copy", ("memcpy", "memset", "copy")),
                 ("fusion", ("fusion",)))


def kernel_group(name: str) -> str:
  """`KERNEL_GROUPS`' group of a device kernel's name, "other" when none matches."""
  lower = name.lower()
  return next((group for group, keys in KERNEL_GROUPS if any(k in lower for k in keys)), "other")


def device_kernel_times(trace_dir: str) -> dict[str, float]:
  """Microseconds per device kernel name in a Perfetto trace
  (`jax.profiler.trace(create_perfetto_trace=True)`): the events on the device processes'
  "Stream" lines (kernels and copies; not the XLA op or module lines); {} without a trace."""
  paths = sorted(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
  if not paths:
    return {}
  with gzip.open(paths[-1], "rt", encoding="utf-8") as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  process = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
  thread = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
  device = {pid for pid, name in process.items() if "/device:" in name}
  totals: dict[str, float] = {}
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in device:
      continue
    if not thread.get((e["pid"], e.get("tid")), "").lower().startswith("stream"):
      continue
    totals[e["name"]] = totals.get(e["name"], 0.0) + float(e.get("dur", 0.0))
  return totals


def profile_summary(trace_dir: str, *, steps: int, top: int) -> dict[str, Any]:
  """Per step: device kernel time, its split by `KERNEL_GROUPS`, and the `top` kernels by time
  (name, milliseconds, share of all device kernel time)."""
  totals = device_kernel_times(trace_dir)
  per_step = lambda us: us / 1e3 / max(steps, 1)
  whole = sum(totals.values())
  groups: dict[str, float] = {}
  for name, us in totals.items():
    groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + per_step(us)
  ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
  return dict(kernel_ms_per_step=per_step(whole), kernel_groups_ms_per_step=groups,
              top_kernels=[dict(kernel=name[:160], ms_per_step=per_step(us),
                                share=us / (whole or 1.0)) for name, us in ranked])


def setup_summary(profiler: cProfile.Profile, *, top: int) -> dict[str, list[dict[str, Any]]]:
  """Where `train.setup.setup` spent its time: `own`, the `top` functions of segpack and the
  trainer by cumulative seconds (callees included), outermost first; `self`, the `top` functions
  of any library by their own seconds (a compile, a wait on the device, a copy)."""
  stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, ncalls, tt, ct, callers)}
  where = lambda f, name: f"{pathlib.Path(f).parent.name}/{pathlib.Path(f).name}:{name}"
  roots = tuple(str(pathlib.Path(d).parent) + os.sep for d in (segpack.__file__, train.__file__))
  own = [(ct, where(f, name)) for (f, _, name), (_, _, _, ct, _) in stats.items()
         if f.startswith(roots)]
  self_ = [(tt, where(f, name)) for (f, _, name), (_, _, tt, _, _) in stats.items()]
  rows = lambda pairs: [dict(function=w, seconds=round(t, 2))
                        for t, w in sorted(pairs, reverse=True)[:top]]
  return dict(own=rows(own), self=rows(self_))


def _advance(run: Any, steps: int) -> list[dict[str, Any]]:
  """`steps` training steps on the run's own data stream; their metrics (not yet fetched)."""
  out = []
  for _ in range(steps):
    local = data_lib.next_batch(run.iterator)
    run.state, metrics = run.train_step(run.state, sharding_lib.global_batch(local, run.mesh))
    out.append(metrics)
  return out


def measure(config: ml_collections.ConfigDict, *, workdir: str, warmup: int, steps: int,
            profile_steps: int, top: int) -> dict[str, Any]:
  """Steps 2-5 of the algorithm: one record."""
  t0 = time.perf_counter()
  setup_lib.preflight(config)  # the config checks and the attention self-check
  preflight_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  profiler = cProfile.Profile() if profile_steps else None
  run = (setup_lib.setup(config, workdir, checked=True) if profiler is None else
         profiler.runcall(setup_lib.setup, config, workdir, checked=True))
  setup_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(_advance(run, warmup))
  warmup_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  window = jax.block_until_ready(_advance(run, steps))
  wall = time.perf_counter() - t0
  window = jax.device_get(window)
  real = sum(float(m["real_tokens"]) for m in window)
  slots = sum(float(m["slots"]) for m in window)
  pairs = sum(float(m["attention_pairs"]) for m in window)
  model = flops_lib.FlopModel.from_model_config(config.model, vocab_size=run.vocab_size)
  flops = model.step_flops(real_tokens=real, attention_pairs=pairs)
  peak = flops_lib.peak_flops(config.train.peak_flops, devices=jax.devices(),
                              compute_dtype=model_config.compute_dtype(config.model.dtype))
  stats = jax.devices()[0].memory_stats() or {}
  rec = dict(params=run.num_params, matmul_params=model.matmul_params,
             seq_len=config.packing.seq_len, strategy=config.packing.strategy,
             batch_size=config.train.batch_size, grad_accum_steps=config.train.grad_accum_steps,
             attention=config.attention.implementation, dtype=config.model.dtype,
             remat=config.model.remat, loss_block_size=config.loss.block_size,
             devices=jax.device_count(), device=jax.devices()[0].device_kind,
             preflight_s=preflight_s, setup_s=setup_s, warmup_steps=warmup, warmup_s=warmup_s, steps=steps, wall_s=wall,
             step_ms=1e3 * wall / steps, real_tokens=real, slots=slots,
             slot_utilization=real / max(slots, 1.0), real_tokens_per_s=real / wall,
             slots_per_s=slots / wall, model_flops_per_s=flops / wall,
             mfu=None if peak is None else flops / wall / peak,
             peak_memory_bytes=stats.get("peak_bytes_in_use"),
             estimated_memory_bytes=getattr(run.memory, "total", None),
             final_loss=float(window[-1]["loss"]))
  if profile_steps:
    trace_dir = os.path.join(workdir, "profile")
    jax.block_until_ready(_advance(run, 1))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      jax.block_until_ready(_advance(run, profile_steps))
    rec.update(profile_dir=trace_dir, **profile_summary(trace_dir, steps=profile_steps, top=top),
               setup_profile=setup_summary(profiler, top=top))
  return rec


def format_table(rec: dict[str, Any]) -> str:
  """The record as a few lines: the run, the rates, the top kernels."""
  mfu = "n/a" if rec["mfu"] is None else f"{rec['mfu']:.1%}"
  lines = [f"{rec['params']:,} parameters, {rec['strategy']} rows of {rec['seq_len']}, batch "
           f"{rec['batch_size']} ({rec['grad_accum_steps']} micro-batches), attention "
           f"{rec['attention']}, {rec['dtype']}, {rec['devices']} x {rec['device']}",
           f"{rec['steps']} steps in {rec['wall_s']:.2f} s ({rec['step_ms']:.1f} ms/step), slot "
           f"utilization {rec['slot_utilization']:.1%}, {rec['real_tokens_per_s']:,.0f} real "
           f"tokens/s, {rec['model_flops_per_s'] / 1e12:.1f} model TFLOP/s, MFU {mfu}"]
  if rec.get("kernel_groups_ms_per_step"):
    lines.append(f"device kernels {rec['kernel_ms_per_step']:.1f} ms/step: " + ", ".join(
        f"{g} {ms:.1f}" for g, ms in sorted(rec["kernel_groups_ms_per_step"].items(),
                                            key=lambda kv: -kv[1])))
  for k in rec.get("top_kernels", []):
    lines.append(f"  {k['ms_per_step']:9.2f} ms/step {k['share']:6.1%}  {k['kernel'][:100]}")
  if rec.get("setup_profile"):
    lines.append(f"setup {rec['setup_s']:.1f} s; its own longest calls: " + ", ".join(
        f"{r['function']} {r['seconds']:.1f} s" for r in rec["setup_profile"]["self"][:5]))
  return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
  """The `steps` subcommand's flags."""
  ap.add_argument("--config", required=True, help="config file[:variant], as train.main's")
  ap.add_argument("--hf-config", default=None,
                  help="a directory with a Hugging Face config.json: its architecture")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="a config override (repeatable), e.g. train.batch_size=4")
  ap.add_argument("--workdir", default=None, help="a fresh run directory (default: temporary)")
  ap.add_argument("--warmup", type=errors.at_least(1), default=2, help="untimed steps first")
  ap.add_argument("--steps", type=errors.at_least(1), default=10, help="timed steps")
  ap.add_argument("--profile-steps", type=errors.at_least(0), default=0,
                  help="steps traced after the timed ones (0: no profile)")
  ap.add_argument("--top", type=errors.at_least(1), default=15, help="kernels listed")
  ap.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
  """`python -m train.bench steps`: prints the record; returns the exit status."""
  config = load_config(args.config)
  if args.hf_config:
    where = os.path.join(args.hf_config, hf_config.CONFIG_NAME)
    hf_config.set_architecture(config.model, hf_config.architecture(
        hf_config.read_config(args.hf_config), where=where))
  apply_overrides(config, args.set)
  workdir = args.workdir or tempfile.mkdtemp(prefix="segpack-steps-")
  rec = measure(config, workdir=workdir, warmup=args.warmup, steps=args.steps,
                profile_steps=args.profile_steps, top=args.top)
  print(json.dumps(rec, sort_keys=True) if args.json else format_table(rec), flush=True)
  return 0

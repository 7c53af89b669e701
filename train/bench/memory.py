"""Peak memory of a training step, measured beside `train.memory`'s estimate.

`python -m train.bench.memory [--quick] [--json]` runs one training step of the trainer
(`train.steps.make_train_step` on `train.model.decoder.build`'s decoder: value_and_grad of the loss,
then AdamW) with the full-logits loss and the blocked loss (`loss.block_size`), with and without
remat (`model.remat`), on one small model (E = 64, 2 layers, one head of 64, F = 128: its dense
XLA attention's `[S, S]` scores, which a GPU's flash kernel never holds, stay small beside the
logits) with Qwen's 151,643-token vocabulary and twice that, on one row of 2,048 or 8,192 slots
(`--quick`: rows of 1,024 and V = 151,643 only, and one case too large for any machine). The
blocked loss runs `BLOCK` positions and `VOCAB_BLOCK` vocabulary columns at a time.

What is measured, per case in a fresh process on one CPU device (`JAX_PLATFORMS=cpu`):
  - `measured`: the step's peak, the memory its arrays need: the peak RSS of the first call of
    the compiled step (VmHWM of /proc/self/status after resetting it through
    /proc/self/clear_refs; `getrusage`'s `ru_maxrss` reads the same counter but carries the
    parent's peak across `exec`), minus the RSS just before the call, plus the bytes of the
    arrays alive before it (the state and the batch). The runtime's own memory (the compiled
    code, what compiling left behind) is left out, as the estimate leaves it out.
  - `rss`: the whole peak of the process above its RSS after the imports (before the model).
  - `xla`: XLA's own account of the compiled step, arguments + outputs - donated + temporaries
    (`compiled.memory_analysis()`).
  - `step s`: the second call's wall time.
Beside each, `estimate`: `train.memory.from_config` of the case's config, with the remat policy
the CPU applies (`train.memory.applied_remat`: none; XLA on the CPU merges the recomputation
back), and `est/meas`. A case whose estimate exceeds `HEADROOM` of the machine's available
memory is skipped with `train.memory.check_fits`'s reason.

Algorithm:
  1. For each case: build its config (`configs/packed.py:smoke`, changed as above), count the
     model's parameters from its abstract shapes, estimate, check that it fits.
  2. Run `python -m train.bench.memory --measure CASE` (steps 3-5) and read its JSON line.
  3. In that process: import, settle the RSS (`gc`, `malloc_trim`), record it; build the model,
     the AdamW state and a batch of one packed row (documents of 512 slots) on the trainer's
     mesh; jit the step as the trainer does (state donated) and compile it ahead of time.
  4. Settle and record the RSS, reset the peak, run the step once and read the peak.
  5. Run the step again and time it; print the figures as one JSON line.
  6. Print the table (or one JSON record per case).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import packed as packed_config
from segpack import errors
from segpack.bench import tables
from segpack.loss import IGNORE_INDEX
from train import memory as memory_lib
from train.bench import hf_import
from train.model import decoder as model_lib
from train import sharding as sharding_lib
from train import steps as steps_lib
from train import objective as objective_lib

PROG = "python -m train.bench.memory"
QWEN_VOCAB = 151_643
BLOCK = 1024  # loss.block_size of the blocked cases
VOCAB_BLOCK = 16_384  # loss.vocab_block_size of the blocked cases
DOC_LEN = 512  # slots per document of the measured row
HEADROOM = 0.8  # share of the available memory a case may be estimated to need
TIMEOUT_S = 900  # one case's process
MODEL = dict(d_model=64, num_layers=2, num_heads=1, num_kv_heads=1, head_dim=64, d_ff=128)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  """One measured step: the vocabulary, the row's slots, the loss and the remat policy."""

  vocab: int
  slots: int  # slots of the batch's one row
  loss: str  # "full" (the whole logits) or "blocked" (loss.block_size = BLOCK)
  remat: str  # model.remat


def _cases(vocabs: Sequence[int], slots: Sequence[int], grid: Sequence[tuple[str, str]]
           ) -> tuple[Case, ...]:
  return tuple(Case(vocab=v, slots=s, loss=loss, remat=remat)
               for v in vocabs for s in slots for loss, remat in grid)


ALL = (("full", "none"), ("blocked", "none"), ("full", "full"), ("blocked", "full"))
CASES = (_cases([QWEN_VOCAB], [2048, 8192], ALL)
         + _cases([2 * QWEN_VOCAB], [2048, 8192], ALL[:2]))
QUICK_CASES = (_cases([QWEN_VOCAB], [1024], ALL[:2])
               + (Case(vocab=2 * QWEN_VOCAB, slots=65_536, loss="full", remat="none"),))


def case_config(case: Case) -> Any:
  """The trainer config of `case`: `configs/packed.py:smoke` with `MODEL`, one row of
  `case.slots` slots, XLA attention and the case's loss and remat."""
  config = packed_config.get_config("smoke")
  for key, value in dict(MODEL, vocab_size=case.vocab).items():
    config.model[key] = value
  config.attention.implementation = "xla"
  config.attention.self_check = False
  config.packing.seq_len = case.slots
  config.train.batch_size = 1
  config.train.grad_accum_steps = 1
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 1
  config.train.num_steps = 10
  config.model.remat = case.remat
  if case.loss == "blocked":
    config.loss.block_size = BLOCK
    config.loss.vocab_block_size = VOCAB_BLOCK
  return config


def _objective(config: Any) -> objective_lib.TokenObjective:
  """The token loss of `config`, full or blocked (`loss.block_size`)."""
  return objective_lib.TokenObjective.from_config(config)


def case_estimate(case: Case) -> memory_lib.MemoryEstimate:
  """`train.memory.from_config` of the case's config on the CPU (parameters counted from the
  model's abstract shapes)."""
  config = case_config(case)
  abstract = model_lib.abstract(config, vocab_size=case.vocab)
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))
  return memory_lib.from_config(config, num_params=num_params, vocab_size=case.vocab,
                                platform="cpu")


def _settled_rss() -> int:
  """The RSS once freed memory is back with the system: `gc`, glibc's `malloc_trim`, then
  until two readings 50 ms apart differ by under 1 MiB (the runtime frees asynchronously)."""
  gc.collect()
  try:
    trim = ctypes.CDLL("libc.so.6").malloc_trim
  except OSError:
    trim = None
  last = -1
  for _ in range(40):
    if trim is not None:
      trim(0)
    now = hf_import.rss_bytes()
    if abs(now - last) < 2**20:
      return now
    last = now
    time.sleep(0.05)
  return last


def _row(rows: int, vocab: int) -> dict[str, np.ndarray]:
  """One packed row of documents of `DOC_LEN` slots (the last shorter), random token ids."""
  ids = np.random.default_rng(0).integers(0, vocab, size=(1, rows), dtype=np.int32)
  slot = np.arange(rows, dtype=np.int32)
  labels = np.roll(ids, -1, axis=1)
  labels[0, (slot % DOC_LEN == DOC_LEN - 1) | (slot == rows - 1)] = IGNORE_INDEX
  return dict(input_ids=ids, labels=labels, segment_ids=(slot // DOC_LEN + 1)[None],
              segment_positions=(slot % DOC_LEN)[None])


def _compiled_step(config: Any, vocab: int) -> tuple[Any, Any, Any]:
  """`(state, batch, compiled step)` as the trainer makes them, on its mesh."""
  mesh = sharding_lib.make_mesh()
  tx, schedule = steps_lib.make_optimizer(config.train)
  graphdef, params = nnx.split(model_lib.build(config, 0, vocab_size=vocab))
  replicated = NamedSharding(mesh, P())
  state = jax.device_put(dict(params=params, opt_state=tx.init(params), step=jnp.int32(0)),
                         replicated)
  batch = sharding_lib.global_batch(_row(config.packing.seq_len, vocab), mesh)
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=1,
                                           objective=_objective(config)),
                 in_shardings=(replicated, sharding_lib.batch_sharding(mesh)),
                 out_shardings=(replicated, replicated), donate_argnames=("state",))
  return state, batch, step.lower(state, batch).compile()


def _xla_bytes(compiled: Any) -> int | None:
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def measure(case: Case) -> dict[str, Any]:
  """Steps 3-5, in a fresh process (`measure_in_subprocess`): the figures of one case."""
  jax.devices()
  base = _settled_rss()
  state, batch, compiled = _compiled_step(case_config(case), case.vocab)
  live = sum(int(x.nbytes) for x in jax.tree.leaves((state, batch)))
  before = _settled_rss()
  reset = hf_import.reset_peak()
  state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  peak = (hf_import.rss_bytes("VmHWM") if reset
          else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
  start = time.perf_counter()
  state, metrics = compiled(state, batch)
  loss = float(metrics["loss"])
  seconds = time.perf_counter() - start
  return dict(measured=peak - before + live, rss=peak - base, xla=_xla_bytes(compiled),
              step_s=seconds, loss_value=loss, live_bytes=live, base_rss=base, rest_rss=before,
              peak_rss=peak, peak_source="VmHWM" if reset else "ru_maxrss",
              device=jax.devices()[0].platform, num_devices=jax.device_count())


def measure_in_subprocess(case: Case, *, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
  """Runs `measure` in a fresh Python on one CPU device; returns its figures.

  Raises:
    RuntimeError: the process failed or ran past `timeout_s`.
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=1"])
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  try:
    proc = subprocess.run([sys.executable, "-m", "train.bench.memory", "--measure",
                           json.dumps(dataclasses.asdict(case))], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=timeout_s)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"the measuring process ran past {timeout_s:.0f} s") from e
  if proc.returncode != 0:
    raise RuntimeError(f"the measuring process ended with status {proc.returncode}: "
                       f"{proc.stderr.strip().splitlines()[-1:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def describe(case: Case) -> str:
  """`V=151,643, 2048 slots, full logits, remat none`."""
  loss = "full logits" if case.loss == "full" else f"blocked loss ({BLOCK} x {VOCAB_BLOCK})"
  return f"V={case.vocab:,}, {case.slots} slots, {loss}, remat {case.remat}"


def run_case(case: Case, *, available: int | None) -> dict[str, Any]:
  """Steps 1-2 for one case: its record, measured or skipped (`note`)."""
  est = case_estimate(case)
  record: dict[str, Any] = dict(dataclasses.asdict(case), estimate=est.total,
                                estimate_parts=est.parts(), measured=None, ratio=None,
                                rss=None, xla=None, step_s=None, note="")
  if case.remat != "none":
    record["note"] = "CPU applies no remat"
  limit = None if available is None else int(HEADROOM * available)
  try:
    memory_lib.check_fits(est, limit, what=describe(case))
  except errors.ArgumentError as e:
    return dict(record, note=f"skipped (over {HEADROOM:.0%} of the available memory): {e}")
  figures = measure_in_subprocess(case)
  record.update(figures)
  record["ratio"] = est.total / figures["measured"]
  return record


def bench(cases: Sequence[Case]) -> list[dict[str, Any]]:
  """Every case's record, in order (step 1's memory check reads the memory available now)."""
  return [run_case(case, available=memory_lib.host_memory()) for case in cases]


def _gib(value: int | None) -> str:
  return "-" if value is None else f"{value / memory_lib.GIB:.2f}"


def format_table(results: list[dict[str, Any]]) -> str:
  """The fixed-width table of the records (sizes in GiB)."""
  head = (f"{'vocab':>7} {'slots':>5} {'loss':<7} {'remat':<5} {'estimate':>8} {'measured':>8} "
          f"{'est/meas':>8} {'rss':>6} {'xla':>6} {'step s':>6}  note")
  rows = []
  for r in results:
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    seconds = "-" if r["step_s"] is None else f"{r['step_s']:.1f}"
    rows.append(f"{r['vocab']:>7} {r['slots']:>5} {r['loss']:<7} {r['remat']:<5} "
                f"{_gib(r['estimate']):>8} {_gib(r['measured']):>8} {ratio:>8} "
                f"{_gib(r['rss']):>6} {_gib(r['xla']):>6} {seconds:>6}  {r['note']}".rstrip())
  return tables.table(head, rows)


def build_parser() -> argparse.ArgumentParser:
  """The `python -m train.bench.memory` parser."""
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="rows of 1,024 slots and V = 151,643 only (under a minute)")
  parser.add_argument("--json", action="store_true", help="print one JSON record per case")
  parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # step 3's process
  return parser


@errors.command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m train.bench.memory ...`; returns the exit status."""
  args = build_parser().parse_args(argv)
  if args.measure is not None:
    print(json.dumps(measure(Case(**json.loads(args.measure)))))
    return 0
  results = bench(QUICK_CASES if args.quick else CASES)
  tables.print_results(results, as_json=args.json, format_table=format_table)
  return 0


if __name__ == "__main__":
  sys.exit(main())

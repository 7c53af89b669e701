"""Adapters side by side: memory of full fine-tuning, LoRA and QLoRA, and QLoRA's quality.

`python -m train.bench.adapters [--quick] [--json] [--rows S] [--steps N]` prints two sections.

Memory: one Llama-shaped model (`MODEL`: E = 2048, 16 layers, 16 heads of 128, 8 KV heads,
F = 5632, V = 32,000; one row of `--rows` = 2,048 slots; `--quick`: 2 layers and rows of 256),
with the CPU's compute dtype (float32: bfloat16 and quantized kernels are converted), trained five
ways with the trainer's own step (`train.steps.make_train_step`, AdamW): full fine-tuning with
float32 and with bfloat16 parameters, LoRA of rank 16 on the seven projections over a bfloat16
base, and QLoRA of rank 16 over an nf4 and an int8 base (`model.lora.base_dtype`). Nothing is
allocated: the step is compiled for abstract shapes on one device and XLA accounts for it
(`compiled.memory_analysis()`: arguments + outputs - donated + temporaries). Beside the peak,
each case's trained and frozen parameters, the bytes of the trained weights, of their AdamW state
and of the frozen base (and of its projections alone: QLoRA keeps embeddings, norms and head in
bfloat16), and the ratios LoRA's optimizer / full fine-tuning's and QLoRA's base / bfloat16's.

Quality: the `configs/packed.py:smoke` model trained `--steps` steps on the small built-in
corpus, then its weights as a frozen base stored in float32, bfloat16, nf4 and int8 (quantized
with `train.model.quantize` from the trained float32 kernels) under fresh adapters (B = 0, so
each adapted model is its base), and a deliberately broken nf4 base (scales doubled: the
negative control). On held-out packed rows, each base against the bfloat16 one: the mean and
largest absolute difference of the label tokens' log-probabilities, the mean absolute logit
difference (real slots), and each base's held-out loss.

Algorithm:
  1. Memory, per case: the config (`case_config`), the abstract model split into trained and
     frozen parts (`train.state.abstract_parts`), the abstract AdamW state
     (`jax.eval_shape(tx.init, trained)`), an abstract batch `int32 [1, S]`.
  2. Count parameters and bytes of each part from the shapes.
  3. Lower `jax.jit(step, donate_argnames=("state",))` on the abstract state, batch and frozen
     base, compile it, and read XLA's memory analysis.
  4. The ratios, from the cases of this one run.
  5. Quality: train the smoke model from scratch (`train_smoke`), keep its float32 parameters.
  6. For each base: build the adapted model (rank 16, that `base_dtype`), fill its frozen
     parameters from the trained ones (`fill_base`: quantized kernels and scales, the rest cast).
  7. Logits of the first held-out batches under every base; compare with the bfloat16 base's.
  8. Print both tables (or one JSON record a line, each with its `section`).

Example: at the default size LoRA trains about 1% of the parameters, so its AdamW state is about
1% of float32 full fine-tuning's (2% of bfloat16's, whose moments are bfloat16), and an nf4
projection is 0.5 + 4/64 bytes a weight, 28% of bfloat16's 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import packed as packed_config
from segpack import errors
from segpack.bench import tables
from train import data as data_lib
from train.model import config as model_config
from train.model import decoder as model_lib
from train import sharding as sharding_lib
from train import steps as steps_lib
from train.model import lora as lora_lib
from train.model import quantize as quantize_lib
from train.adapters import trainable
from train import state as state_lib

PROG = "python -m train.bench.adapters"
MODEL = dict(d_model=2048, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128, d_ff=5632,
             vocab_size=32_000)
ROWS = 2048  # slots of the memory section's one row
QUICK_LAYERS, QUICK_ROWS = 2, 256
RANK = 16
STEPS, QUICK_STEPS = 300, 60  # the quality section's training steps
EVAL_BATCHES, QUICK_EVAL_BATCHES = 8, 2  # held-out batches of 8 rows of 128 slots
MIB = 2**20
PROJECTIONS = tuple(f"/{group}/{name}/" for group, names in
                    (("attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for name in names)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  """One way of fine-tuning the memory section's model."""

  name: str
  param_dtype: str  # model.param_dtype (the trained weights' and their AdamW state's dtype)
  rank: int  # model.lora.rank; 0: full fine-tuning
  base_dtype: str = "param"  # model.lora.base_dtype


CASES = (Case(name="full float32", param_dtype="float32", rank=0),
         Case(name="full bfloat16", param_dtype="bfloat16", rank=0),
         Case(name="LoRA bfloat16", param_dtype="float32", rank=RANK, base_dtype="bfloat16"),
         Case(name="QLoRA nf4", param_dtype="float32", rank=RANK, base_dtype="nf4"),
         Case(name="QLoRA int8", param_dtype="float32", rank=RANK, base_dtype="int8"))


def case_config(case: Case, *, quick: bool, rows: int | None = None) -> Any:
  """The trainer config of `case`: `configs/packed.py:smoke` with `MODEL` (2 layers with
  `quick`), one row of `rows` slots (None: `ROWS`, `QUICK_ROWS` with `quick`), XLA attention,
  the case's dtypes and LoRA."""
  config = packed_config.get_config("smoke")
  for key, value in dict(MODEL, num_layers=QUICK_LAYERS if quick else MODEL["num_layers"],
                         param_dtype=case.param_dtype).items():
    config.model[key] = value
  config.model.lora.rank = case.rank
  config.model.lora.base_dtype = case.base_dtype
  config.attention.implementation = "xla"
  config.packing.seq_len = rows or (QUICK_ROWS if quick else ROWS)
  config.train.batch_size = 1
  return config


def _bytes(tree: Any, *, projections: bool = False) -> int:
  """Bytes of the arrays (or shapes) of `tree`; `projections`: of the seven projections' only."""
  total = 0
  for name, x in sharding_lib.flat_params(tree).items():
    if not projections or any(p in f"/{name}" for p in PROJECTIONS):
      total += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
  return total


def _count(tree: Any) -> int:
  """The weights `tree` holds: a quantized kernel's weights (two nf4 codes a byte), not its
  scales."""
  total = 0
  for name, x in sharding_lib.flat_params(tree).items():
    if not name.endswith("/kernel_scale"):
      total += int(np.prod(x.shape)) * (2 if x.dtype == jnp.uint8 else 1)
  return total


def memory_case(case: Case, *, quick: bool, rows: int | None = None) -> dict[str, Any]:
  """Steps 1-3 for one case: its parameters, bytes and XLA's account of its compiled step."""
  config = case_config(case, quick=quick, rows=rows)
  graphdef, trained, frozen = state_lib.abstract_parts(
      config, vocab_size=config.model.vocab_size, mesh=None, segment_bound=None)
  tx, schedule = steps_lib.make_optimizer(config.train)
  state = dict(params=trained, opt_state=jax.eval_shape(tx.init, trained),
               step=jax.ShapeDtypeStruct((), jnp.int32))
  row = jax.ShapeDtypeStruct((1, config.packing.seq_len), jnp.int32)
  batch = {k: row for k in ("input_ids", "labels", "segment_ids", "segment_positions")}
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=1),
                 donate_argnames=("state",))
  start = time.perf_counter()
  args = (state, batch) if frozen is None else (state, batch, frozen)
  stats = step.lower(*args).compile().memory_analysis()
  seconds = time.perf_counter() - start
  xla = None if stats is None else int(
      stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
      + stats.temp_size_in_bytes)
  return dict(section="memory", case=case.name, rank=case.rank, param_dtype=case.param_dtype,
              base_dtype=case.base_dtype, trained_params=_count(trained),
              frozen_params=0 if frozen is None else _count(frozen),
              trained_bytes=_bytes(trained), optimizer_bytes=_bytes(state["opt_state"]),
              base_bytes=None if frozen is None else _bytes(frozen),
              projection_base_bytes=None if frozen is None else _bytes(frozen, projections=True),
              xla_peak=xla, xla_temp=None if stats is None else int(stats.temp_size_in_bytes),
              compile_s=seconds, device=jax.devices()[0].platform, rows=config.packing.seq_len,
              model=dict(MODEL, num_layers=config.model.num_layers))


def ratios(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Step 4: the issue's ratios from one run's memory records (keyed by case name).

  `lora_optimizer_vs_full_*`: LoRA's AdamW state over full fine-tuning's (float32 and bfloat16
  parameters); `*_base_vs_bfloat16[_projections]`: a quantized base over the bfloat16 base of
  the LoRA case, whole or its projections alone."""
  by = {r["case"]: r for r in records}
  lora = by["LoRA bfloat16"]
  out: dict[str, Any] = dict(section="ratios")
  for dtype in ("float32", "bfloat16"):
    out[f"lora_optimizer_vs_full_{dtype}"] = (lora["optimizer_bytes"]
                                              / by[f"full {dtype}"]["optimizer_bytes"])
  out["lora_trained_params_vs_full"] = lora["trained_params"] / by["full float32"]["trained_params"]
  for kind in ("nf4", "int8"):
    q = by[f"QLoRA {kind}"]
    out[f"{kind}_base_vs_bfloat16"] = q["base_bytes"] / lora["base_bytes"]
    out[f"{kind}_base_vs_bfloat16_projections"] = (q["projection_base_bytes"]
                                                   / lora["projection_base_bytes"])
  return out


def train_smoke(steps: int, *, seed: int = 0) -> tuple[Any, Any, Any]:
  """Step 5: `(config, trained float32 parameters, data)`: the smoke model trained `steps`
  steps from scratch on the small built-in corpus (the trainer's step, one device)."""
  config = packed_config.get_config("smoke")
  config.train.num_steps = steps
  config.train.warmup_steps = max(1, steps // 10)
  config.train.seed = seed
  data = data_lib.make_data(config, batch_size=config.train.batch_size, process_index=0,
                            process_count=1)
  tx, schedule = steps_lib.make_optimizer(config.train)
  graphdef, params = nnx.split(model_lib.build(config, seed, vocab_size=data.vocab_size))
  state = dict(params=params, opt_state=tx.init(params), step=jnp.int32(0))
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=1),
                 donate_argnames=("state",))
  for i in range(steps):
    state, metrics = step(state, _rows(data.train[i]))
  jax.block_until_ready(metrics)
  return config, state["params"], data


def _rows(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  return {k: jnp.asarray(batch[k]) for k in ("input_ids", "labels", "segment_ids",
                                             "segment_positions")}


def fill_base(frozen: Any, floats: dict[str, np.ndarray], *, kind: str | None,
              scale_factor: float = 1.0) -> Any:
  """Step 6: the frozen parameters of an adapted model (`frozen`, its shapes) from the float
  model's (`floats`, by path): a quantized projection's `kernel` (codes) and `kernel_scale`
  (times `scale_factor`: 2 breaks the base on purpose) from `quantize.quantize` of the float
  kernel, every other parameter cast to its frozen dtype."""
  quantized: dict[str, tuple[np.ndarray, np.ndarray]] = {}

  def part(key_path, x):
    path = sharding_lib.param_name(key_path)
    if kind is None or path.rpartition("/")[2] not in quantize_lib.PARTS or not any(
        p in f"/{path}" for p in PROJECTIONS):
      return jnp.asarray(floats[path], dtype=x.dtype)
    source = path.removesuffix("_scale")
    if source not in quantized:
      quantized[source] = quantize_lib.quantize(kind=kind, w_IxO=np.asarray(floats[source]))
    codes, scales_BxO = quantized[source]
    return jnp.asarray(scales_BxO * np.float32(scale_factor) if path.endswith("_scale")
                       else codes)

  return jax.tree_util.tree_map_with_path(part, frozen)


BASES = (("float32", "float32", 1.0), ("bfloat16", "bfloat16", 1.0), ("nf4", "nf4", 1.0),
         ("int8", "int8", 1.0), ("nf4, scales x2 (control)", "nf4", 2.0))


def _label_logprobs(logits_BxSxV: jax.Array, labels_BxS: jax.Array) -> jax.Array:
  """`log p(label)` `[B, S]` (0 where the label is -100)."""
  logp_BxSxV = jax.nn.log_softmax(logits_BxSxV, axis=-1)
  picked_BxS = jnp.take_along_axis(logp_BxSxV, jnp.maximum(labels_BxS, 0)[..., None], axis=-1)
  return jnp.where(labels_BxS >= 0, picked_BxS[..., 0], 0.0)


def base_logits(floats: dict[str, np.ndarray], *, base_dtype: str,
                scale_factor: float, batches: Sequence[dict[str, jax.Array]],
                vocab_size: int) -> list[tuple[jax.Array, jax.Array]]:
  """Steps 6-7 for one base: `(logits [B, S, V], label log-probs [B, S])` of every batch."""
  config = packed_config.get_config("smoke")
  config.model.lora.rank = RANK
  config.model.lora.base_dtype = base_dtype
  graphdef, trained, frozen = lora_lib.split(
      model_lib.build(config, 0, vocab_size=vocab_size), adapters=True)
  kind = lora_lib.quantized(model_config.architecture_fields(config.model)["lora"])
  frozen = fill_base(frozen, floats, kind=kind, scale_factor=scale_factor)
  trained = trainable.adapters_off(trained)  # B = 0: the adapted model is its base

  @jax.jit
  def forward(trained, frozen, batch):
    logits_BxSxV = lora_lib.merge(graphdef, trained, frozen).batch_logits(batch)
    return logits_BxSxV, _label_logprobs(logits_BxSxV, batch["labels"])

  return [forward(trained, frozen, b) for b in batches]


def quality(steps: int, *, eval_batches: int) -> list[dict[str, Any]]:
  """Steps 5-7: one record per base (`BASES`), each compared with the bfloat16 base."""
  start = time.perf_counter()
  _, params, data = train_smoke(steps)
  train_s = time.perf_counter() - start
  floats = {name: np.asarray(x, np.float32)
            for name, x in sharding_lib.flat_params(params).items()}
  batches = [_rows(data.eval[i]) for i in range(min(eval_batches, len(data.eval)))]
  outputs = {name: base_logits(floats, base_dtype=dtype, scale_factor=factor,
                               batches=batches, vocab_size=data.vocab_size)
             for name, dtype, factor in BASES}
  labelled_BxS = [np.asarray(b["labels"]) >= 0 for b in batches]
  real_BxS = [np.asarray(b["segment_ids"]) != 0 for b in batches]
  tokens = int(sum(m.sum() for m in labelled_BxS))
  records = []
  for name, dtype, factor in BASES:
    logp_diffs, logit_sum, nll = [], 0.0, 0.0
    for (logits_BxSxV, logp_BxS), (ref_logits_BxSxV, ref_logp_BxS), labelled, real in zip(
        outputs[name], outputs["bfloat16"], labelled_BxS, real_BxS):
      logp_diffs.append(np.abs(np.asarray(logp_BxS) - np.asarray(ref_logp_BxS))[labelled])
      logit_sum += float(np.abs(np.asarray(logits_BxSxV)
                                - np.asarray(ref_logits_BxSxV))[real].sum())
      nll -= float(np.asarray(logp_BxS)[labelled].sum())
    diffs = np.concatenate(logp_diffs)
    records.append(dict(
        section="quality", base=name, base_dtype=dtype, scale_factor=factor,
        mean_abs_logprob_diff=float(diffs.mean()), max_abs_logprob_diff=float(diffs.max()),
        mean_abs_logit_diff=logit_sum / (sum(int(r.sum()) for r in real_BxS) * data.vocab_size),
        eval_loss=nll / tokens, eval_tokens=tokens, eval_rows=sum(len(r) for r in real_BxS),
        train_steps=steps, train_s=train_s,
        weights=f"configs/packed.py:smoke trained {steps} steps on the small built-in corpus"))
  return records


def bench(*, quick: bool, steps: int | None = None,
          rows: int | None = None) -> list[dict[str, Any]]:
  """Every record of both sections, in order: the memory cases, the ratios, the bases."""
  memory = [memory_case(case, quick=quick, rows=rows) for case in CASES]
  steps = (QUICK_STEPS if quick else STEPS) if steps is None else steps
  return memory + [ratios(memory)] + quality(
      steps, eval_batches=QUICK_EVAL_BATCHES if quick else EVAL_BATCHES)


def _mib(value: int | None) -> str:
  return "-" if value is None else f"{value / MIB:,.1f}"


def _memory_table(memory: list[dict[str, Any]]) -> list[str]:
  """The memory section's heading and table (sizes in MiB)."""
  m = memory[0]["model"]
  head = (f"{'case':<14} {'trained':>13} {'frozen':>13} {'weights':>9} {'optimizer':>9} "
          f"{'base':>9} {'proj. base':>10} {'xla peak':>9} {'xla temp':>9}")
  return [f"Memory: E={m['d_model']}, {m['num_layers']} layers, {m['num_heads']} heads of "
          f"{m['head_dim']} ({m['num_kv_heads']} KV), F={m['d_ff']}, V={m['vocab_size']:,}, "
          f"one row of {memory[0]['rows']} slots; LoRA rank {RANK} on the seven projections; "
          f"XLA's account of the compiled step on one {memory[0]['device']} device (MiB)", "",
          tables.table(head, [
              f"{r['case']:<14} {r['trained_params']:>13,} {r['frozen_params']:>13,} "
              f"{_mib(r['trained_bytes']):>9} {_mib(r['optimizer_bytes']):>9} "
              f"{_mib(r['base_bytes']):>9} {_mib(r['projection_base_bytes']):>10} "
              f"{_mib(r['xla_peak']):>9} {_mib(r['xla_temp']):>9}" for r in memory])]


def _quality_table(quality_: list[dict[str, Any]]) -> list[str]:
  """The quality section's heading and table."""
  q = quality_[0]
  head = (f"{'base':<26} {'mean |dlogp|':>12} {'max |dlogp|':>12} {'mean |dlogit|':>13} "
          f"{'eval loss':>9}")
  return [f"Quality: {q['weights']}; {q['eval_rows']} held-out rows of 128 slots, "
          f"{q['eval_tokens']:,} label tokens; each base against the bfloat16 base", "",
          tables.table(head, [
              f"{r['base']:<26} {r['mean_abs_logprob_diff']:>12.5f} "
              f"{r['max_abs_logprob_diff']:>12.5f} {r['mean_abs_logit_diff']:>13.5f} "
              f"{r['eval_loss']:>9.4f}" for r in quality_])]


def format_table(records: list[dict[str, Any]]) -> str:
  """The memory table, the ratios and the quality table (each where `records` hold it)."""
  sections: list[list[str]] = []
  memory = [r for r in records if r["section"] == "memory"]
  if memory:
    sections.append(_memory_table(memory))
  for r in (r for r in records if r["section"] == "ratios"):
    sections.append(
        [f"LoRA optimizer / full fine-tuning's: {r['lora_optimizer_vs_full_float32']:.2%} "
         f"(float32 parameters), {r['lora_optimizer_vs_full_bfloat16']:.2%} (bfloat16); "
         f"trained parameters {r['lora_trained_params_vs_full']:.2%}"]
        + [f"{kind} base / bfloat16 base: {r[f'{kind}_base_vs_bfloat16']:.2%} whole, "
           f"{r[f'{kind}_base_vs_bfloat16_projections']:.2%} projections alone"
           for kind in ("nf4", "int8")])
  quality_ = [r for r in records if r["section"] == "quality"]
  if quality_:
    sections.append(_quality_table(quality_))
  return "\n\n".join("\n".join(lines) for lines in sections)


def build_parser() -> argparse.ArgumentParser:
  """The `python -m train.bench.adapters` parser."""
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK_LAYERS} layers, rows of {QUICK_ROWS}, {QUICK_STEPS} "
                           "training steps, fewer held-out rows")
  parser.add_argument("--json", action="store_true", help="print one JSON record a line")
  parser.add_argument("--rows", type=errors.at_least(1), default=None,
                      help=f"slots of the memory section's row (default {ROWS}, --quick "
                           f"{QUICK_ROWS})")
  parser.add_argument("--steps", type=errors.at_least(1), default=None,
                      help=f"training steps of the quality section's model (default {STEPS}, "
                           f"--quick {QUICK_STEPS})")
  return parser


@errors.command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m train.bench.adapters ...`; returns the exit status."""
  args = build_parser().parse_args(argv)
  records = bench(quick=args.quick, steps=args.steps, rows=args.rows)
  tables.print_results(records, as_json=args.json, format_table=format_table)
  return 0


if __name__ == "__main__":
  sys.exit(main())

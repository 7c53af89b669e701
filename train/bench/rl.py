"""`python -m train.bench rl`: GRPO updates on groups padded, packed with the prompt copied, and
packed with the prompt stored once, side by side; and the split of a step.

Algorithm:
  1. Draw `--prompts` groups of a realistic shape (seeded): prompts log-normal around `--prompt`
     tokens, `--generations` completions each, long-tailed (log-normal around `--completion`,
     sigma 1, at most `--max-completion`).
  2. Lay the round out three ways:
     - `padded`: every completion after its prompt in a row of its own, `--padded-rows` rows a
       step, each step as wide as its longest sequence (rounded up to 64), as TRL's GRPO pads;
     - `copied`: the groups packed whole into rows of `--seq-len` by exact FFD
       (`segpack.packing.groups.plan_groups`), every completion after its own prompt copy;
     - `shared`: the same, each group's prompt stored once, its completions as branches.
  3. For each layout compile the trainer's step of the RL objective (`train.steps`,
     `train.rl.objective`) on every batch shape once, then time the round's update: completion
     tokens trained per second and the round's time.
  4. The split of a step with the shared layout: sampling the round's completions (the rollout
     engine, the prompts' lengths, each group capped at its longest drawn completion), scoring
     (the old log-probs on the training rows) and the update.

On a CPU the XLA attention computes every row's whole `[S, S]` score matrix; on a GPU the Pallas
kernel skips other segments' blocks. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import grpo as grpo_config
from segpack import errors
from segpack.data import groups as group_rows_lib
from segpack.loss.labels import IGNORE_INDEX
from segpack.packing import groups as groups_lib
from train import sharding as sharding_lib
from train import steps as steps_lib
from train.model import decoder as model_lib
from train.model import head_loss
from train.rl import objective as rl_objective
from train.rollout import engine

LAYOUTS = ("padded", "copied", "shared")
VOCAB = 512


def make_groups(*, prompts: int, generations: int, prompt: int, completion: int,
                max_completion: int, seq_len: int,
                seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
  """Step 1: the round's prompts and completions (random ids), each group drawn again until it
  fits a row with its prompt copied per completion (the largest layout)."""
  rng = np.random.default_rng(seed)
  ps, cs = [], []
  while len(ps) < prompts:
    p = int(np.clip(rng.lognormal(np.log(prompt), 0.4), 8, 4 * prompt))
    lengths = np.clip(rng.lognormal(np.log(completion), 1.0, generations), 1,
                      max_completion).astype(int)
    if groups_lib.group_slots(p, lengths, layout="copied") > seq_len:
      continue
    ps.append([1] + rng.integers(3, VOCAB, p - 1).tolist())
    cs.append([rng.integers(3, VOCAB, int(n)).tolist() for n in lengths])
  return ps, cs


def _padded_steps(ps, cs, rows: int) -> list[dict[str, np.ndarray]]:
  flat = [(p, c) for p, group in zip(ps, cs) for c in group]
  out = []
  for first in range(0, len(flat), rows):
    part = flat[first:first + rows]
    width = -(-max(len(p) + len(c) for p, c in part) // 64) * 64
    plan = groups_lib.GroupPlan(
        seq_len=width, row_splits=np.arange(len(part) + 1), group=np.arange(len(part)),
        member=np.zeros(len(part), np.int32), start=np.zeros(len(part), np.int32),
        length=np.asarray([len(p) + len(c) for p, c in part], np.int32), stats={})
    out.append(group_rows_lib.group_rows(plan, prompts=[p for p, _ in part],
                                         completions=[[c] for _, c in part],
                                         completion_values={"advantages": [[1.0]] * len(part)},
                                         num_rows=len(part)))
  return out


def layout_steps(ps, cs, layout: str, *, seq_len: int, batch_size: int,
                 padded_rows: int) -> list[dict[str, np.ndarray]]:
  """Step 2: the round's steps of one layout."""
  if layout == "padded":
    return _padded_steps(ps, cs, padded_rows)
  plan = groups_lib.plan_groups(prompt_lengths=[len(p) for p in ps],
                                completion_lengths=[[len(c) for c in g] for g in cs],
                                seq_len=seq_len, layout=layout)
  adv = [[1.0] * len(g) for g in cs]
  rows = group_rows_lib.group_rows(plan, prompts=ps, completions=cs,
                                   completion_values={"advantages": adv})
  if layout == "copied":
    rows.pop("prefix_segment_ids")
  out = []
  for first in range(0, plan.num_rows, batch_size):
    part = {k: v[first:first + batch_size] for k, v in rows.items()}
    pad = batch_size - len(part["labels"])
    fill = {"labels": IGNORE_INDEX, "completion_index": -1}
    out.append({k: np.pad(v, ((0, pad), (0, 0)), constant_values=fill.get(k, 0))
                for k, v in part.items()})
  return out


def _setup(config: Any):
  mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])  # one device: steps of any row count
  tx, schedule = steps_lib.make_optimizer(config.train)
  model = model_lib.build(config, 0, vocab_size=VOCAB, mesh=mesh)
  graphdef, params = nnx.split(model)
  replicated = NamedSharding(mesh, P())
  state = jax.device_put(dict(params=params, opt_state=tx.init(params), step=jnp.int32(0)),
                         replicated)
  objective = rl_objective.from_config(config)
  step = jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=1, objective=objective),
                 out_shardings=(replicated, replicated), donate_argnames=("state",))
  score = jax.jit(lambda p, b: -head_loss.token_losses(nnx.merge(graphdef, p), b, block_size=0))
  return mesh, model, state, step, score


def _timed(fn, batches) -> float:
  for width in sorted({b["input_ids"].shape[1] for b in batches}):  # compile each shape once
    jax.block_until_ready(fn(next(b for b in batches if b["input_ids"].shape[1] == width)))
  t0 = time.perf_counter()
  out = None
  for b in batches:
    out = fn(b)
  jax.block_until_ready(out)
  return time.perf_counter() - t0


def run_layout(parts, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
  """Step 3: one layout's scoring pass and update, timed after compiling every shape."""
  mesh, _, state, step, score = parts
  with jax.set_mesh(mesh):
    device = [sharding_lib.global_batch(b, mesh) for b in batches]
    scoring = _timed(lambda b: score(state["params"], b), device)
    for b, d in zip(batches, device):
      b["old_logp"] = np.asarray(score(state["params"], d))
    device = [sharding_lib.global_batch(b, mesh) for b in batches]
    update = _timed(lambda b: step(jax.tree.map(jnp.copy, state), b), device)
  slots = sum(b["input_ids"].size for b in batches)
  real = sum(int((b["segment_ids"] != 0).sum()) for b in batches)
  trained = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
  return dict(steps=len(batches), slots=slots, utilization=real / slots, score_s=scoring,
              update_s=update, trained_tokens=trained, tokens_per_s=trained / update)


def _sampling_s(parts, ps, cs) -> float:
  """Step 4's sampling time: the round's completions drawn by the rollout engine."""
  _, model, *_ = parts
  caps = [max(len(c) for c in g) for g in cs]
  engine.generate(model, ps[:1], max_new_tokens=2, num_samples=len(cs[0]))  # compile
  t0 = time.perf_counter()
  engine.generate(model, ps, max_new_tokens=caps, num_samples=len(cs[0]), seed=0,
                  max_len=max(len(p) for p in ps) + max(caps))
  return time.perf_counter() - t0


def bench(*, prompts: int, generations: int, prompt: int, completion: int, max_completion: int,
          seq_len: int, batch_size: int, padded_rows: int, d_model: int, seed: int,
          sample: bool = True) -> dict[str, Any]:
  """Steps 1-4; the JSON-able result."""
  ps, cs = make_groups(prompts=prompts, generations=generations, prompt=prompt,
                       completion=completion, max_completion=max_completion, seq_len=seq_len,
                       seed=seed)
  config = grpo_config.get_config()
  config.packing.seq_len, config.train.batch_size = seq_len, batch_size
  config.attention.implementation = config.attention.implementation or None
  m = config.model
  m.num_layers, m.d_model, m.d_ff, m.head_dim = 2, d_model, 4 * d_model, 64
  m.num_heads, m.num_kv_heads = max(1, d_model // 64), max(1, d_model // 128)
  parts = _setup(config)
  lengths = [len(c) for g in cs for c in g]
  out: dict[str, Any] = dict(
      prompts=prompts, generations=generations, prompt_median=int(np.median([len(p) for p in ps])),
      completion_median=int(np.median(lengths)), completion_max=int(max(lengths)),
      seq_len=seq_len, batch_size=batch_size, padded_rows=padded_rows, d_model=d_model,
      device=str(jax.devices()[0].platform), num_devices=1)
  for layout in LAYOUTS:
    result = run_layout(parts, layout_steps(ps, cs, layout, seq_len=seq_len,
                                            batch_size=batch_size, padded_rows=padded_rows))
    out.update({f"{layout}_{k}": v for k, v in result.items()})
  for layout in LAYOUTS:
    out[f"{layout}_vs_padded"] = out[f"{layout}_tokens_per_s"] / out["padded_tokens_per_s"]
  out["shared_vs_copied"] = out["shared_tokens_per_s"] / out["copied_tokens_per_s"]
  out["sample_s"] = _sampling_s(parts, ps, cs) if sample else None
  return out


def table(r: dict[str, Any]) -> str:
  """Steps 3 and 4's table."""
  lines = [f"{r['prompts']} prompts x {r['generations']} completions (prompt median "
           f"{r['prompt_median']}, completion median {r['completion_median']}, max "
           f"{r['completion_max']} tokens), seq_len {r['seq_len']}, {r['batch_size']} rows a "
           f"step ({r['padded_rows']} padded), d_model {r['d_model']}, {r['num_devices']} "
           f"{r['device']} device(s)",
           f"{'':8} {'steps':>6} {'slots':>10} {'util':>7} {'update (s)':>11} "
           f"{'trained tok/s':>14} {'vs padded':>10}"]
  for name in LAYOUTS:
    lines.append(f"{name:8} {r[name + '_steps']:>6} {r[name + '_slots']:>10,} "
                 f"{r[name + '_utilization']:>7.1%} {r[name + '_update_s']:>11.2f} "
                 f"{r[name + '_tokens_per_s']:>14,.0f} {r[name + '_vs_padded']:>9.2f}x")
  lines.append(f"shared vs copied: {r['shared_vs_copied']:.2f}x")
  sample = "not measured" if r["sample_s"] is None else f"{r['sample_s']:.2f} s"
  lines.append(f"a step of the shared layout: sampling {sample}, scoring "
               f"{r['shared_score_s']:.2f} s, update {r['shared_update_s']:.2f} s")
  return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The `rl` subcommand's flags."""
  p.add_argument("--prompts", type=errors.at_least(1), default=8, help="prompts in the round")
  p.add_argument("--generations", type=errors.at_least(1), default=8,
                 help="completions per prompt")
  p.add_argument("--prompt", type=errors.at_least(2), default=384, help="median prompt tokens")
  p.add_argument("--completion", type=errors.at_least(1), default=96,
                 help="median completion tokens (long-tailed)")
  p.add_argument("--max-completion", type=errors.at_least(1), default=768,
                 help="the longest completion")
  p.add_argument("--seq-len", type=errors.at_least(64), default=8192, help="slots per row")
  p.add_argument("--batch-size", type=errors.at_least(1), default=2, help="packed rows per step")
  p.add_argument("--padded-rows", type=errors.at_least(1), default=16,
                 help="padded rows (sequences) per step")
  p.add_argument("--d-model", type=errors.at_least(64), default=256, help="the model's width")
  p.add_argument("--seed", type=int, default=0, help="the lengths' seed")
  p.add_argument("--no-sample", action="store_true", help="leave out the sampling time")
  p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
  result = bench(prompts=args.prompts, generations=args.generations, prompt=args.prompt,
                 completion=args.completion, max_completion=args.max_completion,
                 seq_len=args.seq_len, batch_size=args.batch_size, padded_rows=args.padded_rows,
                 d_model=args.d_model, seed=args.seed, sample=not args.no_sample)
  print(json.dumps(result, sort_keys=True) if args.json else table(result))
  return 0

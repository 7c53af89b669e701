"""`train_and_evaluate(config, workdir)`: the training loop, for any objective.

Algorithm:
  1. Set up (`train.setup`): checks, mesh, data, state (fresh or restored), the objective
     prepared, the jitted steps.
  2. Loop: fetch this process's rows, assemble the global batch, run the jitted step (gradient
     accumulation with one global count, AdamW, clipping: `train.steps`), log, evaluate,
     checkpoint; a stop signal saves at the next step boundary.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np

from train import data as data_lib
from train.model import flops as flops_lib
from train import metrics as metrics_lib
from train import objective as objective_lib
from train import run_guard
from train import setup as setup_lib
from train import sharding as sharding_lib
from train.model import config as model_config
from train.run_guard import check_workdir
from train.setup import Run


def evaluate(run: Run) -> dict[str, float]:
  """Held-out loss over the first `train.eval_batches` eval batches (all of them if <= 0).

  With `loss.weighting="sequence"` it is the mean of per-document means over all the documents
  of the evaluated batches. For a mixture, every source is evaluated on its own held-out
  documents (`train.eval_batches` batches of each) and `eval_loss` is the mixture of their
  losses by the sources' token shares, `sum_s w_s * eval_loss/s`: the expected per-token loss
  of the training mixture. An objective with an `evaluate(run)` of its own (RL: the held-out
  prompts' rewards, `train.rl.objective`) measures instead."""
  own = getattr(run.objective, "evaluate", None)  # an objective with a measure of its own (RL)
  if own is not None:
    return own(run)
  if not run.data.eval_by_source:
    loss, tokens, means = _eval_loss(run, run.data.eval)
    return dict(eval_loss=loss, eval_tokens=tokens, **means)
  out, total, weights = {}, 0, run.data.source_weights
  for name, dataset in run.data.eval_by_source.items():
    out[f"eval_loss/{name}"], out[f"eval_tokens/{name}"], _ = _eval_loss(run, dataset)
    total += out[f"eval_tokens/{name}"]
  shares = np.asarray(weights, np.float64) / np.sum(weights)
  headline = sum(float(w) * out[f"eval_loss/{name}"]
                 for name, w in zip(run.data.source_names, shares))
  return dict(eval_loss=headline, eval_tokens=total, **out)


def _eval_loss(run: Run, dataset: Any) -> tuple[float, int, dict[str, float]]:
  """`(loss, trained tokens, other means)` over the first `train.eval_batches` batches of
  `dataset`; the other means are a preference objective's metrics per pair."""
  limit = run.config.train.eval_batches
  n = len(dataset) if limit <= 0 else min(limit, len(dataset))
  sums: dict[str, float] = {}
  for i in range(n):
    local = dataset[i]  # every process's rows of a global batch, padding rows at the end
    out = run.eval_step(run.state["params"], sharding_lib.global_batch(local, run.mesh))
    for key, value in jax.device_get(out).items():
      sums[key] = sums.get(key, 0.0) + float(value)
  count = max(sums.get("count", 0.0), 1.0)
  means = {f"eval_{k}": v / count for k, v in sums.items()
           if k not in ("loss_sum", "count", "trained_tokens")}
  return sums.get("loss_sum", 0.0) / count, int(sums.get("trained_tokens", 0)), means


def train_and_evaluate(config: Any, workdir: str | os.PathLike, *,
                       objective: objective_lib.Objective | None = None) -> dict[str, Any]:
  """Trains the model `config` describes, resuming from `workdir` if it holds a checkpoint.

  The workdir is locked for the run (`train.run_guard`); SIGINT / SIGTERM save a checkpoint at
  the next step boundary and raise `run_guard.RunStopped`. A run already at `train.num_steps`
  trains nothing and appends nothing.

  Args:
    config: a trainer config (`configs/packed.py:get_config()`).
    workdir: checkpoints, `metrics.jsonl`, `run.json` and `batches*.jsonl` go here.
    objective: what the run trains (`train.objective.Objective`); by default the config's
      (`train.setup.objective_of`).

  Returns:
    The summary record (also printed and appended to `metrics.jsonl`), or for a finished run a
    `{"kind": "finished", ...}` record that is only printed.
  """
  setup_lib.preflight(config)  # a refused config writes nothing, not even the lock file
  created = not os.path.exists(workdir)
  path = check_workdir(workdir)
  with run_guard.workdir_lock(path, enabled=jax.process_index() == 0, created=created):
    run = setup_lib.setup(config, path, checked=True, objective=objective)
    if run.start_step >= config.train.num_steps:
      run.checkpointer.close()
      message = (f"the run in {run.workdir} is finished at step {run.start_step} "
                 f"(train.num_steps={config.train.num_steps}); nothing to do: raise "
                 f"--config.train.num_steps to train further")
      if jax.process_index() == 0:
        print(f"train.main: {message}", flush=True)
      return dict(kind="finished", step=run.start_step, workdir=run.workdir, message=message)
    with run_guard.StopSignals() as signals:
      return _train_loop(run, signals)


def _train_loop(run: Run, signals: run_guard.StopSignals) -> dict[str, Any]:
  """Step 4 of the algorithm: the steps from `run.start_step + 1` to `train.num_steps`."""
  config = run.config
  t = config.train
  is_main = jax.process_index() == 0
  writer = metrics_lib.MetricsWriter(run.workdir, enabled=is_main,
                                     describe=run.objective.describe)
  suffix = "" if jax.process_count() == 1 else f".p{jax.process_index()}"
  batches_path = os.path.join(run.workdir, f"batches{suffix}.jsonl") if t.log_batches else None
  if is_main:
    metrics_lib.announce(run, record_name=run_guard.RECORD_NAME)
  t0, first_loss, last_loss, eval_rec, real_total = time.perf_counter(), None, None, None, 0.0
  initial_eval = None
  evals = t.eval_every > 0 and run.data.eval is not None  # data.eval_share=0: no held-out data
  if run.start_step == 0 and evals:
    eval_rec = dict(kind="eval", step=0, **evaluate(run))
    initial_eval = eval_rec["eval_loss"]
    writer.write(eval_rec)
  meter = metrics_lib.Throughput(
      start_step=run.start_step, num_steps=t.num_steps,
      flop_model=flops_lib.FlopModel.from_model_config(config.model,
                                                       vocab_size=run.vocab_size),
      peak_flops=flops_lib.peak_flops(t.peak_flops, devices=jax.devices(),
                                      compute_dtype=model_config.compute_dtype(config.model.dtype)))
  window = []
  for step in range(run.start_step + 1, t.num_steps + 1):
    position = run.iterator.get_state() if batches_path else None
    local = data_lib.next_batch(run.iterator)
    metrics_lib.log_batch(batches_path, step, local, position,
                          getattr(run.iterator, "last_plan_rows", None))
    run.state, step_metrics = run.train_step(run.state, sharding_lib.global_batch(local, run.mesh))
    if window:  # one step in flight at most: a stop lands within a step (docs/training.md)
      jax.block_until_ready(window[-1]["loss"])
    window.append(step_metrics)
    last_step, stopping = step == t.num_steps, signals.requested is not None
    evaluating = evals and (step % t.eval_every == 0 or last_step)
    saving = last_step or stopping or (t.checkpoint_every > 0 and step % t.checkpoint_every == 0)
    if step % t.log_every == 0 or evaluating or saving:  # never evaluate or save a bad state
      window = jax.device_get(window)  # the only device->host sync of the steps in between
      run_guard.check_finite(step + 1 - len(window), window, checkpointer=run.checkpointer,
                             learning_rate=t.learning_rate)
    if step % t.log_every == 0 or last_step or stopping:
      real_total += sum(float(m["real_tokens"]) for m in window)
      record, window = metrics_lib.train_record(step, window, meter, run.objective), []
      first_loss = record["loss"] if first_loss is None else first_loss
      last_loss = record["loss"]
      writer.write(record)
    if evaluating:
      eval_rec = dict(kind="eval", step=step, **evaluate(run))
      run_guard.check_finite(step, [eval_rec], checkpointer=run.checkpointer,
                             learning_rate=t.learning_rate)
      writer.write(eval_rec)
    run.checkpointer.maybe_save(step, run.state, run.iterator.get_state(), run.config_dict,
                                force=last_step or stopping)
    if stopping:
      run.checkpointer.close()
      writer.close()
      raise signals.stopped(step=step, checkpoint_dir=run.checkpointer.directory)
  run.checkpointer.close()
  elapsed = time.perf_counter() - t0
  summary = dict(kind="summary", steps=t.num_steps, resumed_from=run.start_step,
                 first_logged_loss=first_loss, final_loss=last_loss,
                 initial_eval_loss=initial_eval,
                 final_eval_loss=None if eval_rec is None else eval_rec["eval_loss"],
                 real_tokens=int(real_total), wall_s=elapsed,
                 real_tokens_per_s=real_total / max(elapsed, 1e-9), params=run.num_params,
                 workdir=run.workdir)
  writer.write(summary)
  writer.close()
  return summary

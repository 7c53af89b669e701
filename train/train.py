"""`train_and_evaluate(config, workdir)`: the training loop on packed, sharded batches.

Algorithm:
  1. Check the workdir; build the mesh; pack the data (each process its own rows).
  2. Derive the state's shardings from abstract shapes, then initialise it into them (jit).
  3. Restore the latest checkpoint if there is one (state + data position; its config must
     match), from any process count (the position is a row of the global stream).
  4. Loop: fetch this process's rows, assemble the global batch, run the jitted step (gradient
     accumulation with one global token count, AdamW, clipping), log, evaluate, checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from segpack import loss as loss_lib
from train import checkpoint as ckpt_lib
from train import config_checks
from train import data as data_lib
from train import flops as flops_lib
from train import head_loss
from train.adapters import lora as lora_lib
from train.adapters import state as adapter_state
from train.hf import init_from as hf_init
from train.preference import data as preference_data
from train.preference import objective as preference_objective
from train.preference import reference as preference_reference
from train.preference import scoring
from train import layout as layout_lib
from train import memory as memory_lib
from train import metrics as metrics_lib
from train import model as model_lib
from train import recipe as recipe_lib
from train import run_guard
from train.config_checks import AttentionConfigError, check_attention, check_attention_leaks
from train.run_guard import WorkdirError, check_workdir
from train import sharding as sharding_lib


def make_optimizer(train_cfg: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup then cosine decay, after global-norm gradient clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train_cfg.learning_rate,
      warmup_steps=train_cfg.warmup_steps,
      decay_steps=max(train_cfg.num_steps, train_cfg.warmup_steps + 1),
      end_value=train_cfg.learning_rate * train_cfg.min_lr_ratio)
  tx = optax.chain(
      optax.clip_by_global_norm(train_cfg.grad_clip) if train_cfg.grad_clip > 0
      else optax.identity(),
      optax.adamw(schedule, b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps,
                  weight_decay=train_cfg.weight_decay,
                  mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params)))
  return tx, schedule


def make_train_step(graphdef: Any, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    *, accum: int, weighting: str = "token", num_sources: int = 0,
                    block_size: int = 0, vocab_block_size: int = 0,
                    objective: Any = None, seed: int = 0) -> Callable[..., Any]:
  """The (unjitted) step `(state, batch[, frozen]) -> (state, metrics)` (`frozen`: the base
  under adapters, `train.adapters.state`; the state's `params` are then the adapters).

  The loss of every micro-batch is divided by the count of the *whole* batch (trained tokens, or
  with `weighting="sequence"` documents with trained tokens: `loss.weighting`), so the summed
  gradients are exactly those of the full batch's loss. With `num_sources` (a mixture whose rows
  carry `segment_sources`) the metrics also hold every source's summed token loss and trained
  tokens (`source_loss_sum`, `source_tokens`, `[num_sources]` each). `finite`: the loss, gradient
  norm and every element of the new state are finite (the loop checks it, `run_guard.check_finite`).
  `block_size` > 0 computes the token losses in blocks from the final hidden states, never the
  whole logits (`loss.block_size`, `loss.vocab_block_size`: `train.head_loss`). An `objective`
  (`train.preference.objective.PreferenceObjective`) replaces the token loss: the step's loss is
  its mean over the batch's pairs, and the metrics hold its sums (`METRICS`). Adapters with
  dropout draw their masks from `seed`, the step and the micro-batch (the same on a resume).
  """
  loss_lib.check_weighting(weighting, name="loss.weighting")

  def loss_fn(params, micro, total):
    if objective is not None:
      return objective.loss_and_sums(lora_lib.model_of(graphdef, params), micro, total)
    token_loss_BxS = head_loss.token_losses(lora_lib.model_of(graphdef, params), micro,
                                            block_size=block_size,
                                            vocab_block_size=vocab_block_size)
    loss_sum = loss_lib.token_loss_sum(token_loss_BxS, micro["labels"], weighting=weighting,
                                       segment_ids_BxS=micro["segment_ids"])[0]
    loss = loss_sum / jnp.maximum(jnp.asarray(total, jnp.float32), 1.0)
    if not num_sources:
      return loss, ()
    return loss, loss_lib.token_loss_by_source(
        jax.lax.stop_gradient(token_loss_BxS), micro["labels"], micro["segment_sources"],
        num_sources=num_sources)

  def step(state, batch, frozen=None):
    total = objective.normalizer(batch) if objective is not None else loss_lib.loss_normalizer(
        batch["labels"], weighting=weighting, segment_ids_BxS=batch["segment_ids"])
    params = state["params"]

    def with_frozen(trained, micro, total, index):  # the frozen base gets no gradient
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), state["step"]), index)
      with lora_lib.dropout_key(key):  # adapters' dropout (model.lora.dropout), if any
        return loss_fn(trained if frozen is None else (trained, frozen), micro, total)

    def accumulate(carry, micro_and_index):
      grads_acc, loss_acc, aux_acc = carry
      micro, index = micro_and_index
      (loss, aux), grads = jax.value_and_grad(with_frozen, has_aux=True)(params, micro, total,
                                                                        index)
      return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss,
              jax.tree.map(jnp.add, aux_acc, aux)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    aux0 = (jnp.zeros(num_sources, jnp.float32),) * 2 if num_sources else ()
    aux0 = objective.zeros() if objective is not None else aux0
    (grads, loss, aux), _ = jax.lax.scan(
        accumulate, (zeros, jnp.float32(0), aux0),
        (layout_lib.micro_batches(batch, accum), jnp.arange(accum, dtype=jnp.uint32)))
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = dict(params=optax.apply_updates(params, updates), opt_state=opt_state,
                     step=state["step"] + 1)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.all(jnp.stack([jnp.isfinite(loss), jnp.isfinite(grad_norm)] + [
        jnp.isfinite(x).all() for x in jax.tree.leaves(new_state)]))
    real = jnp.sum(batch["segment_ids"] != 0, dtype=jnp.float32)
    metrics = dict(loss=loss, grad_norm=grad_norm, finite=finite, lr=schedule(state["step"]),
                   trained_tokens=loss_lib.count_trained_tokens(batch["labels"]),
                   loss_count=total, real_tokens=real,
                   slots=jnp.float32(batch["segment_ids"].size),
                   attention_pairs=flops_lib.attention_pairs(
                       batch["segment_ids"], reordered="slot_index" in batch))
    if num_sources:
      metrics.update(source_loss_sum=aux[0], source_tokens=aux[1])
    if objective is not None:
      metrics.update(aux)
    return new_state, metrics

  return step


def make_eval_step(graphdef: Any, *, weighting: str = "token", block_size: int = 0,
                   vocab_block_size: int = 0, objective: Any = None) -> Callable[..., Any]:
  """`(params, batch) -> sums` of one held-out batch: `loss_sum`, `count`, `trained_tokens`.

  `loss_sum / count` is the batch's loss: with `weighting="token"` the summed token losses over
  the trained tokens, with `"sequence"` the summed per-document mean losses over the documents;
  with an `objective`, the summed pair losses over the pairs, and its metric sums too.
  `block_size`, `vocab_block_size`: as `make_train_step`'s.
  """
  loss_lib.check_weighting(weighting, name="loss.weighting")

  def step(params, batch, frozen=None):
    model = lora_lib.model_of(graphdef, params if frozen is None else (params, frozen))
    tokens = loss_lib.count_trained_tokens(batch["labels"])
    if objective is not None:
      count = objective.normalizer(batch)
      sums = objective.loss_and_sums(model, batch, count)[1]
      return dict(sums, count=count, trained_tokens=tokens)
    token_loss_BxS = head_loss.token_losses(model, batch, block_size=block_size,
                                            vocab_block_size=vocab_block_size)
    loss_sum, count = loss_lib.token_loss_sum(token_loss_BxS, batch["labels"],
                                              weighting=weighting,
                                              segment_ids_BxS=batch["segment_ids"])
    return dict(loss_sum=loss_sum, count=count, trained_tokens=tokens)

  return step


@dataclasses.dataclass
class Run:
  """Everything `train_and_evaluate` sets up before the loop."""

  config: Any
  config_dict: dict[str, Any]
  workdir: str
  mesh: Any
  data: data_lib.Data
  state: Any
  state_shardings: Any
  train_step: Callable[..., Any]
  eval_step: Callable[..., Any]
  checkpointer: ckpt_lib.Checkpointer
  iterator: Any
  start_step: int
  num_params: int
  resume_changes: list[str] = dataclasses.field(default_factory=list)
  vocab_size: int = 0  # the model's: `model.vocab_size`, or the data's when that is None
  recipe: recipe_lib.Resolved | None = None  # how the length, rate and warmup were chosen
  memory: memory_lib.MemoryEstimate | None = None  # the step's estimated peak per device
  reference: str | None = None  # where a preference loss's reference scores came from
  frozen_params: int = 0  # the frozen base's parameters under adapters (`num_params`: trained)


def _abstract_state(config: Any, vocab_size: int, tx: optax.GradientTransformation,
                    mesh: Any, segment_bound: int | None = None):
  """`(graphdef, the state's shapes)`; under adapters the state trains the adapters only (the
  frozen shapes: `adapter_state.abstract_parts`)."""
  graphdef, abstract_params, _ = adapter_state.abstract_parts(
      config, vocab_size=vocab_size, mesh=mesh, segment_bound=segment_bound)
  return graphdef, dict(params=abstract_params, opt_state=jax.eval_shape(tx.init, abstract_params),
                        step=jax.ShapeDtypeStruct((), jnp.int32))


def preflight(config: Any) -> None:
  """The checks that need no data and write nothing: config values, the imported model's keys,
  the attention backend and its leak check."""
  config_checks.check_config(config)
  adapter_state.check(config)
  if config.model.init_from is not None:
    hf_init.check_adopted(config)
  implementation = check_attention(config.attention, platform=jax.default_backend())
  check_attention_leaks(config, implementation=implementation)


def _make_data(config: Any, mesh: Any, *, preference: bool):
  """`(data, splits)`: the run's batches, and for a preference loss its pair datasets."""
  layout = dict(batch_size=config.train.batch_size, process_index=jax.process_index(),
                process_count=jax.process_count())
  if preference:
    return preference_data.make_preference_data(config, **layout)
  return data_lib.make_data(config, num_ranks=sharding_lib.batch_partitions(mesh), **layout), None


def setup(config: Any, workdir: str, *, checked: bool = False) -> Run:
  """Steps 1-3 of the algorithm: workdir, mesh, data, state, restore (`checked`: preflight ran)."""
  if not checked:
    preflight(config)
  workdir = check_workdir(workdir)
  t = config.train
  mesh = sharding_lib.make_mesh(data=config.mesh.data, fsdp=config.mesh.fsdp,
                                tensor=config.mesh.tensor, context=config.mesh.context)
  sharding_lib.check_batch(t.batch_size, mesh=mesh, grad_accum_steps=t.grad_accum_steps,
                           process_count=jax.process_count())
  objective = preference_objective.from_config(config)
  data, splits = _make_data(config, mesh, preference=objective is not None)
  resolved = recipe_lib.resolve_config(
      config, steps_per_epoch=data.train_rows_in_epoch0 / t.batch_size)  # metrics.announce prints it
  fingerprints = run_guard.data_fingerprints(train=config.data.train, eval_path=config.data.eval)
  run_guard.check_run_record(workdir, fingerprints)  # before a checkpoint can be blamed
  if config.model.init_from is not None:
    hf_init.check_tokenizer(config.model.init_from, data_fingerprint=data.tokenizer_fingerprint,
                            data_name=data_lib.data_name(config))
  vocab_size = config_checks.check_vocab_size(config, data.vocab_size)
  tx, schedule = make_optimizer(t)
  graphdef, abstract_params, abstract_frozen = adapter_state.abstract_parts(
      config, vocab_size=vocab_size, mesh=mesh, segment_bound=data.segment_bound)
  abstract = dict(params=abstract_params, opt_state=jax.eval_shape(tx.init, abstract_params),
                  step=jax.ShapeDtypeStruct((), jnp.int32))
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract["params"]))
  frozen = (None if abstract_frozen is None else
            adapter_state.frozen_base(config, abstract_frozen, mesh))  # before a resume's check
  estimate = memory_lib.check_run(config, num_params, vocab_size, mesh,  # before compiling
                                  frozen_bytes=0 if frozen is None else frozen.bytes)
  replicated = NamedSharding(mesh, P())
  params_sh = sharding_lib.param_shardings(abstract["params"], mesh)
  state_sh = dict(params=params_sh,
                  opt_state=sharding_lib.opt_state_shardings(tx, abstract["params"], params_sh,
                                                             mesh),
                  step=replicated)
  config_dict = json.loads(config.to_json())
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       every=t.checkpoint_every, max_to_keep=t.max_checkpoints,
                                       base=None if frozen is None else frozen.fingerprint)
  iterator = data.train_iterator(
      read_options=grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
  abstract_sh = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             abstract, state_sh)
  restored = checkpointer.restore_or_none(abstract_sh, config_dict)
  if restored is None:
    state, start_step, changes = adapter_state.initial_state(
        config, workdir, abstract, state_sh, tx, vocab_size=vocab_size, mesh=mesh,
        segment_bound=data.segment_bound, adapters=frozen is not None), 0, []
  else:
    state, start_step, changes = restored.state, restored.step, restored.changes
    iterator.set_state(restored.data_state)
  blocks = dict(block_size=config.loss.block_size,
                vocab_block_size=config.loss.vocab_block_size)
  reference = None
  if objective is not None and objective.needs_reference:  # before a step changes the weights
    reference = preference_reference.prepare(
        config, workdir, splits, step=scoring.make_score_step(graphdef, **blocks),
        params=(state["params"] if frozen is None else
                (adapter_state.adapters_off(state["params"]), frozen.params)),  # the base alone
        mesh=mesh, resumed=restored is not None)
  if jax.process_index() == 0:
    run_guard.keep_run_record(workdir, config_dict, fingerprints, fresh=restored is None)
    run_guard.keep_datasets(workdir, run_guard.training_dirs(config.data.train))
  batch_sh = sharding_lib.batch_sharding(mesh) if objective is None else None  # pairs: as given
  weighting = config.loss.weighting
  blocks["objective"] = objective
  train_step = make_train_step(graphdef, tx, schedule, accum=t.grad_accum_steps,
                               weighting=weighting, num_sources=len(data.source_names),
                               seed=t.seed, **blocks)
  eval_step = make_eval_step(graphdef, weighting=weighting, **blocks)
  train_step, eval_step = adapter_state.jit_steps(train_step, eval_step, state_sh=state_sh, batch_sh=batch_sh,
                                     replicated=replicated, frozen=frozen)
  return Run(config=config, config_dict=config_dict, workdir=workdir, mesh=mesh, data=data,
             state=state, state_shardings=state_sh, train_step=train_step, eval_step=eval_step,
             checkpointer=checkpointer, iterator=iterator, start_step=int(start_step),
             num_params=num_params, resume_changes=changes, vocab_size=vocab_size,
             recipe=resolved, memory=estimate, reference=reference,
             frozen_params=0 if frozen is None else frozen.num_params)


def evaluate(run: Run) -> dict[str, float]:
  """Held-out loss over the first `train.eval_batches` eval batches (all of them if <= 0).

  With `loss.weighting="sequence"` it is the mean of per-document means over all the documents
  of the evaluated batches. For a mixture, every source is evaluated on its own held-out
  documents (`train.eval_batches` batches of each) and `eval_loss` is the mixture of their
  losses by the sources' token shares, `sum_s w_s * eval_loss/s`: the expected per-token loss
  of the training mixture."""
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


def train_and_evaluate(config: Any, workdir: str | os.PathLike) -> dict[str, Any]:
  """Trains the model `config` describes, resuming from `workdir` if it holds a checkpoint.

  The workdir is locked for the run (`train.run_guard`); SIGINT / SIGTERM save a checkpoint at
  the next step boundary and raise `run_guard.RunStopped`. A run already at `train.num_steps`
  trains nothing and appends nothing.

  Args:
    config: a trainer config (`configs/packed.py:get_config()`).
    workdir: checkpoints, `metrics.jsonl`, `run.json` and `batches*.jsonl` go here.

  Returns:
    The summary record (also printed and appended to `metrics.jsonl`), or for a finished run a
    `{"kind": "finished", ...}` record that is only printed.
  """
  preflight(config)  # a refused config writes nothing, not even the lock file
  path = check_workdir(workdir)
  with run_guard.workdir_lock(path, enabled=jax.process_index() == 0):
    run = setup(config, path, checked=True)
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
  writer = metrics_lib.MetricsWriter(run.workdir, enabled=is_main)
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
                                      compute_dtype=model_lib.compute_dtype(config.model.dtype)))
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
      record, window = metrics_lib.train_record(step, window, meter, run.data.source_names), []
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

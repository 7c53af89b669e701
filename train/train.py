"""`train_and_evaluate(config, workdir)`: the training loop on packed, sharded batches.

Algorithm:
  1. Check the workdir; build the mesh; pack the data (each process its own rows).
  2. Derive parameter and optimizer-state shardings from abstract shapes (`nnx.eval_shape`,
     `jax.eval_shape`), then initialise the state directly into them under `jax.jit`.
  3. Restore the latest checkpoint if there is one (state + data position), after checking that
     its config matches. The data position is a row of the global stream, so the checkpoint may
     come from another process count (or batch size, with `train.allow_batch_size_change`).
  4. Loop: fetch this process's rows, assemble the global batch, run the jitted step (gradient
     accumulation over micro-batches with one global token count, AdamW, clipping), log metrics,
     evaluate on the held-out split, checkpoint every N steps and at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Any, Callable

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from segpack import attention as attention_lib
from segpack import loss as loss_lib
from segpack.data.options import PipelineConfigError
from train import checkpoint as ckpt_lib
from train import config_checks
from train import data as data_lib
from train import flops as flops_lib
from train import hf_config
from train import hf_init
from train import metrics as metrics_lib
from train import model as model_lib
from train import sharding as sharding_lib


class WorkdirError(OSError):
  """The workdir cannot be created or written."""


def check_workdir(workdir: str | os.PathLike) -> str:
  """Creates `workdir` if needed and proves it writable with an atomic probe file."""
  path = os.path.abspath(os.fspath(workdir))
  try:
    os.makedirs(path, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
    os.close(fd)
    os.replace(probe, probe + ".done")
    os.remove(probe + ".done")
  except OSError as e:
    raise WorkdirError(f"--workdir {path!r} is not writable: {e}") from e
  return path


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


def _micro_batches(batch: dict[str, jax.Array], accum: int) -> dict[str, jax.Array]:
  """`[A*M, S]` -> `[A, M, S]` with micro-batch `a` = rows `a, A + a, ...`, so each device's
  contiguous block of rows splits evenly over the micro-batches (no resharding)."""
  return {k: jnp.swapaxes(v.reshape(-1, accum, v.shape[-1]), 0, 1) for k, v in batch.items()}


def make_train_step(graphdef: Any, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    *, accum: int, weighting: str = "token",
                    num_sources: int = 0) -> Callable[..., Any]:
  """The (unjitted) step `(state, batch) -> (state, metrics)`.

  The loss of every micro-batch is divided by the count of the *whole* batch (trained tokens, or
  with `weighting="sequence"` documents with trained tokens: `loss.weighting`), so the summed
  gradients are exactly those of the full batch's loss. With `num_sources` (a mixture whose rows
  carry `segment_sources`) the metrics also hold every source's summed token loss and trained
  tokens (`source_loss_sum`, `source_tokens`, `[num_sources]` each). `finite`: the loss, gradient
  norm and every element of the new state are finite (the loop checks it, `check_finite`).
  """
  loss_lib.check_weighting(weighting, name="loss.weighting")

  def loss_fn(params, micro, total):
    logits = nnx.merge(graphdef, params).batch_logits(micro)
    loss = loss_lib.cross_entropy_loss(logits, micro["labels"], normalizer=total,
                                       weighting=weighting,
                                       segment_ids_BxS=micro["segment_ids"])[0]
    if not num_sources:
      return loss, ()
    return loss, loss_lib.cross_entropy_by_source(
        jax.lax.stop_gradient(logits), micro["labels"], micro["segment_sources"],
        num_sources=num_sources)

  def step(state, batch):
    total = loss_lib.loss_normalizer(batch["labels"], weighting=weighting,
                                     segment_ids_BxS=batch["segment_ids"])
    params = state["params"]

    def accumulate(carry, micro):
      grads_acc, loss_acc, aux_acc = carry
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, micro, total)
      return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss,
              jax.tree.map(jnp.add, aux_acc, aux)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    aux0 = (jnp.zeros(num_sources, jnp.float32),) * 2 if num_sources else ()
    (grads, loss, aux), _ = jax.lax.scan(accumulate, (zeros, jnp.float32(0), aux0),
                                         _micro_batches(batch, accum))
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
    return new_state, metrics

  return step


def make_eval_step(graphdef: Any, *, weighting: str = "token") -> Callable[..., Any]:
  """`(params, batch) -> (loss_sum, count, trained_tokens)` for one held-out batch.

  `loss_sum / count` is the batch's loss: with `weighting="token"` the summed token losses over
  the trained tokens, with `"sequence"` the summed per-document mean losses over the documents.
  """
  loss_lib.check_weighting(weighting, name="loss.weighting")

  def step(params, batch):
    logits = nnx.merge(graphdef, params).batch_logits(batch)
    loss_sum, count = loss_lib.cross_entropy_sum(logits, batch["labels"], weighting=weighting,
                                                 segment_ids_BxS=batch["segment_ids"])
    return loss_sum, count, loss_lib.count_trained_tokens(batch["labels"])

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


def _abstract_state(config: Any, vocab_size: int, tx: optax.GradientTransformation,
                    mesh: Any, max_segments_in_row: int | None = None):
  abstract_model = nnx.eval_shape(lambda: model_lib.build(
      config, config.train.seed, vocab_size=vocab_size, mesh=mesh,
      max_segments_in_row=max_segments_in_row))
  graphdef, abstract_params = nnx.split(abstract_model)
  return graphdef, dict(params=abstract_params, opt_state=jax.eval_shape(tx.init, abstract_params),
                        step=jax.ShapeDtypeStruct((), jnp.int32))


class NonFiniteError(ArithmeticError):
  """A step's loss, gradient norm or update is not finite; the run stops without saving it."""


def check_finite(first_step: int, window: list[dict[str, Any]], *,
                 checkpointer: ckpt_lib.Checkpointer, learning_rate: float) -> None:
  """Raises `NonFiniteError` at the first step of `window` (fetched metrics of the steps
  `first_step, first_step + 1, ...`, or eval records) with a non-finite value or `finite` flag."""
  for step, m in enumerate(window, start=first_step):
    bad = [f"the {k.replace('_', ' ')} is {float(m[k])}" for k in ("loss", "grad_norm", "eval_loss")
           if k in m and not np.isfinite(float(m[k]))]
    if not bad and bool(m.get("finite", True)):
      continue
    what = bad[0] if bad else "the new parameters or optimizer state are not finite"
    kept = checkpointer.latest_step()
    kept = "there is no checkpoint" if kept is None else f"the checkpoint of step {kept} is kept"
    raise NonFiniteError(
        f"step {step}: {what}; stopped without saving it, {kept} (try a train.learning_rate "
        f"lower than {learning_rate:g}, a longer train.warmup_steps or train.grad_clip > 0)")


class AttentionConfigError(ValueError):
  """The `attention` config group asks for a backend this platform cannot run, or gives a backend
  a setting it does not use."""


# What a config, a workdir or a checkpoint can get wrong: `python -m train.main` prints these as
# one line naming the key or file (exit code 2) instead of a traceback.
USER_ERRORS = (config_checks.ConfigError, data_lib.DataConfigError, model_lib.ModelConfigError,
               sharding_lib.MeshConfigError, AttentionConfigError, WorkdirError,
               *ckpt_lib.ERRORS, hf_config.HfModelError,
               PipelineConfigError, NonFiniteError)


def check_attention(attention_cfg: Any, *, platform: str) -> None:
  """Refuses what `segpack.attention.resolve_implementation` refuses (it holds the rules, e.g.
  Pallas on the CPU only in interpret mode), naming the config keys (JAX's own error names none)."""
  try:
    attention_lib.resolve_implementation(
        implementation=attention_cfg.implementation, platform=platform,
        pallas=model_lib.pallas_options(attention_cfg))
  except attention_lib.AttentionInputError as e:
    raise AttentionConfigError(
        f"attention.implementation={attention_cfg.implementation!r} with attention.interpret="
        f"{bool(attention_cfg.interpret)} on the {platform!r} platform: {e} (config keys: "
        "`implementation` is attention.implementation, and `pallas.interpret=True` is "
        "attention.interpret=True)") from e


def _compute_dtype(config: Any) -> str:
  return (config.model.dtype if config.model.dtype != "auto"
          else model_lib.default_compute_dtype())


def check_attention_leaks(config: Any) -> attention_lib.SelfCheckResult | None:
  """Unless `attention.self_check` is False, runs `segpack.attention.self_check` on the configured
  backend (None: the library's default for the platform; with `attention.interpret`, in the
  model's compute dtype) and lets its `AttentionLeakError` stop the run before any work."""
  a = config.attention
  if not a.self_check:
    return None
  return attention_lib.self_check(implementation=a.implementation,
                                  pallas=model_lib.pallas_options(a), dtype=_compute_dtype(config))


def setup(config: Any, workdir: str) -> Run:
  """Steps 1-3 of the algorithm: workdir, mesh, data, sharded state, restore."""
  config_checks.check_config(config)
  if config.model.init_from is not None:
    hf_init.check_adopted(config)
  check_attention(config.attention, platform=jax.default_backend())
  check_attention_leaks(config)
  workdir = check_workdir(workdir)
  t = config.train
  mesh = sharding_lib.make_mesh(data=config.mesh.data, fsdp=config.mesh.fsdp,
                                tensor=config.mesh.tensor, context=config.mesh.context)
  sharding_lib.check_batch(t.batch_size, mesh=mesh, grad_accum_steps=t.grad_accum_steps,
                           process_count=jax.process_count())
  data = data_lib.make_data(data_lib.DataSpec.from_config(config), batch_size=t.batch_size,
                            process_index=jax.process_index(), process_count=jax.process_count(),
                            num_ranks=sharding_lib.batch_partitions(mesh))
  if config.model.init_from is not None:
    hf_init.check_tokenizer(config.model.init_from, data_fingerprint=data.tokenizer_fingerprint,
                            data_name=data_lib.DataSpec.from_config(config).name)
  vocab_size = config_checks.check_vocab_size(config, data.vocab_size)
  tx, schedule = make_optimizer(t)
  graphdef, abstract = _abstract_state(config, vocab_size, tx, mesh,
                                       max_segments_in_row=data.max_segments_in_row)
  replicated = NamedSharding(mesh, P())
  params_sh = sharding_lib.param_shardings(abstract["params"], mesh)
  state_sh = dict(params=params_sh,
                  opt_state=sharding_lib.opt_state_shardings(tx, abstract["params"], params_sh,
                                                             mesh),
                  step=replicated)
  config_dict = json.loads(config.to_json())
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       every=t.checkpoint_every, max_to_keep=t.max_checkpoints)
  iterator = data.train_iterator(
      read_options=grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
  abstract_sh = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             abstract, state_sh)
  restored = checkpointer.restore_or_none(abstract_sh, config_dict)
  if restored is None and config.model.init_from is not None:
    hf_init.keep_source_files(config.model.init_from, workdir)
    state, start_step, changes = hf_init.initial_state(config, abstract["params"], state_sh,
                                                       tx.init), 0, []
  elif restored is None:
    def init():
      params = nnx.split(model_lib.build(config, t.seed, vocab_size=vocab_size, mesh=mesh,
                                         max_segments_in_row=data.max_segments_in_row))[1]
      return dict(params=params, opt_state=tx.init(params), step=jnp.int32(0))
    state, start_step, changes = jax.jit(init, out_shardings=state_sh)(), 0, []
  else:
    state, start_step, changes = restored.state, restored.step, restored.changes
    iterator.set_state(restored.data_state)
  batch_sh = sharding_lib.batch_sharding(mesh)
  weighting = config.loss.weighting
  train_step = jax.jit(make_train_step(graphdef, tx, schedule, accum=t.grad_accum_steps,
                                       weighting=weighting,
                                       num_sources=len(data.source_names)),
                       in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                       donate_argnames=("state",))
  eval_step = jax.jit(make_eval_step(graphdef, weighting=weighting),
                      in_shardings=(params_sh, batch_sh),
                      out_shardings=(replicated, replicated, replicated))
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract["params"]))
  return Run(config=config, config_dict=config_dict, workdir=workdir, mesh=mesh, data=data,
             state=state, state_shardings=state_sh, train_step=train_step, eval_step=eval_step,
             checkpointer=checkpointer, iterator=iterator, start_step=int(start_step),
             num_params=num_params, resume_changes=changes, vocab_size=vocab_size)


def evaluate(run: Run) -> dict[str, float]:
  """Held-out loss over the first `train.eval_batches` eval batches (all of them if <= 0).

  With `loss.weighting="sequence"` it is the mean of per-document means over all the documents
  of the evaluated batches."""
  loss, tokens = _eval_loss(run, run.data.eval)
  out = dict(eval_loss=loss, eval_tokens=tokens)
  for name, dataset in run.data.eval_by_source.items():  # a mixture: each source's own
    out[f"eval_loss/{name}"], out[f"eval_tokens/{name}"] = _eval_loss(run, dataset)
  return out


def _eval_loss(run: Run, dataset: Any) -> tuple[float, int]:
  """`(loss, trained tokens)` over the first `train.eval_batches` batches of `dataset`."""
  limit = run.config.train.eval_batches
  n = len(dataset) if limit <= 0 else min(limit, len(dataset))
  loss_sum, count, tokens = 0.0, 0.0, 0.0
  for i in range(n):
    local = dataset[i]  # every process's rows of a global batch, padding rows at the end
    s, c, k = run.eval_step(run.state["params"], sharding_lib.global_batch(local, run.mesh))
    loss_sum, count, tokens = loss_sum + float(s), count + float(c), tokens + float(k)
  return loss_sum / max(count, 1.0), int(tokens)


def _log_batch(path: str | None, step: int, local: dict[str, np.ndarray],
               position: dict[str, Any] | None = None, plan_rows: Any = None) -> None:
  """Appends the step's batch fingerprints, the data position the batch started at and (global
  packing) every local row's `[epoch, plan row]` to `path` (nothing when None)."""
  if path is None:
    return
  whole, rows = data_lib.fingerprint(local)
  record = dict(step=step, fingerprint=whole, rows=rows, position=position)
  if plan_rows is not None:
    record["plan_rows"] = np.stack(plan_rows, axis=1).tolist()
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")
    f.flush()


def train_and_evaluate(config: Any, workdir: str | os.PathLike) -> dict[str, Any]:
  """Trains the model `config` describes, resuming from `workdir` if it holds a checkpoint.

  Args:
    config: a trainer config (`configs/packed.py:get_config()`).
    workdir: checkpoints, `metrics.jsonl` and `batches*.jsonl` go here.

  Returns:
    The summary record (also printed and appended to `metrics.jsonl`).
  """
  run = setup(config, os.fspath(workdir))
  t = config.train
  is_main = jax.process_index() == 0
  writer = metrics_lib.MetricsWriter(run.workdir, enabled=is_main)
  suffix = "" if jax.process_count() == 1 else f".p{jax.process_index()}"
  batches_path = os.path.join(run.workdir, f"batches{suffix}.jsonl") if t.log_batches else None
  if is_main:
    print(f"{run.data.description}; {run.num_params:,} parameters; mesh {dict(run.mesh.shape)}; "
          f"{'resuming at step ' + str(run.start_step) if run.start_step else 'from scratch'}",
          flush=True)
    if run.resume_changes:
      print(f"resuming at data position {run.iterator.get_state()} with changes: "
            f"{'; '.join(run.resume_changes)}", flush=True)
  t0, first_loss, last_loss, eval_rec, real_total = time.perf_counter(), None, None, None, 0.0
  initial_eval = None
  if run.start_step == 0 and t.eval_every > 0:
    eval_rec = dict(kind="eval", step=0, **evaluate(run))
    initial_eval = eval_rec["eval_loss"]
    writer.write(eval_rec)
  meter = metrics_lib.Throughput(
      start_step=run.start_step, num_steps=t.num_steps,
      flop_model=flops_lib.FlopModel.from_model_config(config.model,
                                                       vocab_size=run.vocab_size),
      peak_flops=flops_lib.peak_flops(t.peak_flops, devices=jax.devices(),
                                      compute_dtype=_compute_dtype(config)))
  window = []
  for step in range(run.start_step + 1, t.num_steps + 1):
    position = run.iterator.get_state() if batches_path else None
    local = next(run.iterator)
    _log_batch(batches_path, step, local, position, getattr(run.iterator, "last_plan_rows", None))
    run.state, step_metrics = run.train_step(run.state, sharding_lib.global_batch(local, run.mesh))
    window.append(step_metrics)
    last_step = step == t.num_steps
    evaluating = t.eval_every > 0 and (step % t.eval_every == 0 or last_step)
    saving = last_step or (t.checkpoint_every > 0 and step % t.checkpoint_every == 0)
    if step % t.log_every == 0 or evaluating or saving:  # never evaluate or save a bad state
      window = jax.device_get(window)  # the only device->host sync of the steps in between
      check_finite(step + 1 - len(window), window, checkpointer=run.checkpointer,
                   learning_rate=t.learning_rate)
    if step % t.log_every == 0 or last_step:
      real_total += sum(float(m["real_tokens"]) for m in window)
      record, window = metrics_lib.train_record(step, window, meter, run.data.source_names), []
      first_loss = record["loss"] if first_loss is None else first_loss
      last_loss = record["loss"]
      writer.write(record)
    if evaluating:
      eval_rec = dict(kind="eval", step=step, **evaluate(run))
      check_finite(step, [eval_rec], checkpointer=run.checkpointer, learning_rate=t.learning_rate)
      writer.write(eval_rec)
    run.checkpointer.maybe_save(step, run.state, run.iterator.get_state(), run.config_dict,
                                force=last_step)
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
  return summary

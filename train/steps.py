"""The optimizer and the (unjitted) train and eval steps, for any objective (`train.objective`).

Algorithm of the train step:
  1. The objective's normaliser of the whole global batch (trained tokens, documents, pairs).
  2. Over `accum` micro-batches (`jax.lax.scan`): the objective's loss of each divided by that
     one count, its gradient with respect to the trained parameters (the frozen base of an
     adapter run gets none), the objective's metric sums; all summed.
  3. The optimizer's update (AdamW after clipping), and the step's metrics: loss, gradient
     norm, `finite`, learning rate, token and slot counts, and the objective's sums.

Because every micro-batch divides by the count of the whole batch, the summed gradients are
exactly those of the full batch's loss, whatever `accum` is.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from segpack import loss as loss_lib
from train.model import flops as flops_lib
from train import objective as objective_lib
from train.model import layout as layout_lib
from train.model import lora as lora_lib

TOKENS = objective_lib.TokenObjective()  # the token loss with the configs' defaults


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
                    *, accum: int, objective: objective_lib.Objective = TOKENS,
                    seed: int = 0) -> Callable[..., Any]:
  """The step `(state, batch, frozen=None) -> (state, metrics)` of the module's algorithm.

  Args:
    graphdef: the decoder's graph (`nnx.split`).
    tx, schedule: `make_optimizer`'s.
    accum: micro-batches per step (`train.grad_accum_steps`).
    objective: the loss and metric sums (`train.objective.Objective`).
    seed: adapters with dropout draw their masks from it, the step and the micro-batch (the
      same on a resume).

  The state's `params` are what trains; `frozen` is the frozen base under adapters
  (`train.state`). `finite`: the loss, gradient norm and every element of the new state are
  finite (the loop checks it, `run_guard.check_finite`).
  """

  def loss_fn(trained, frozen, micro, total, key):
    with lora_lib.dropout_key(key):  # adapters' dropout (model.lora.dropout), if any
      return objective.loss_and_sums(lora_lib.model_of(graphdef, trained, frozen), micro, total)

  def step(state, batch, frozen=None):
    total = objective.normalizer(batch)
    params = state["params"]

    def accumulate(carry, micro_and_index):
      grads_acc, loss_acc, sums_acc = carry
      micro, index = micro_and_index
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), state["step"]), index)
      (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, micro,
                                                                       total, key)
      return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss,
              jax.tree.map(jnp.add, sums_acc, sums)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss, sums), _ = jax.lax.scan(
        accumulate, (zeros, jnp.float32(0), objective.zeros()),
        (layout_lib.micro_batches(batch, accum), jnp.arange(accum, dtype=jnp.uint32)))
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = dict(params=optax.apply_updates(params, updates), opt_state=opt_state,
                     step=state["step"] + 1)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.all(jnp.stack([jnp.isfinite(loss), jnp.isfinite(grad_norm)] + [
        jnp.isfinite(x).all() for x in jax.tree.leaves(new_state)]))
    metrics = dict(loss=loss, grad_norm=grad_norm, finite=finite, lr=schedule(state["step"]),
                   trained_tokens=loss_lib.count_trained_tokens(batch["labels"]),
                   loss_count=total,
                   real_tokens=jnp.sum(batch["segment_ids"] != 0, dtype=jnp.float32),
                   slots=jnp.float32(batch["segment_ids"].size),
                   attention_pairs=flops_lib.attention_pairs(
                       batch["segment_ids"], reordered="slot_index" in batch))
    return new_state, dict(metrics, **sums)

  return step


def make_eval_step(graphdef: Any, *,
                   objective: objective_lib.Objective = TOKENS) -> Callable[..., Any]:
  """`(params, batch, frozen=None) -> sums` of one held-out batch: the objective's `loss_sum`,
  `count` and metric sums, and `trained_tokens`; `loss_sum / count` is the batch's loss."""

  def step(params, batch, frozen=None):
    sums = objective.eval_sums(lora_lib.model_of(graphdef, params, frozen), batch)
    return dict(sums, trained_tokens=loss_lib.count_trained_tokens(batch["labels"]))

  return step

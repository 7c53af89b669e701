"""`loss.block_size`: the trainer's step with the blocked loss equals the step with the full
logits (`train.model.head_loss`), on one device and on the explicit mesh.

One device: a small float32 decoder on packed rows (documents back to back, `-100` at each
document's end and on padding, a row of one-token documents with nothing to train), both
weightings, tied and untied heads, gradient accumulation, per-source sums, vocabulary chunks;
the loss, the gradients of every parameter and the parameters after one AdamW step agree
within 1e-6 (relative to each array's largest value; Adam's squared gradients within 2e-6).
On the mesh of 8 CPU devices, the run's own step (`train.setup.setup`: the config keys reach
it) against the same config's step with the full logits and no remat: the vocabulary split
over `tensor`, with context parallelism and `model.remat`; the metrics, the new state and its
shardings.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from configs import packed
from support.packing_oracles import naive_rows
from support.train_configs import synthetic_config
from train import data as data_lib
from train.model import config as model_config
from train.model import decoder as model_lib
from train import sharding as sharding_lib
from train import steps as steps_lib
from train import setup as setup_lib
from train.objective import TokenObjective

VOCAB = 211  # no block or chunk size below divides it
SEQ_LEN = 28
RTOL = 1e-6


@functools.lru_cache(maxsize=None)
def _model(tied):
  cfg = model_config.DecoderConfig(vocab_size=VOCAB, num_layers=1, d_model=32, num_heads=4,
                                num_kv_heads=2, head_dim=8, d_ff=48, init_std=0.2,
                                tie_embeddings=tied, attention_implementation="xla",
                                dtype="float32")
  return nnx.split(model_lib.Decoder(cfg, rngs=nnx.Rngs(params=0)))


@functools.lru_cache(maxsize=None)
def _batch():
  rng = np.random.default_rng(0)
  rows = [[9, 4, 15], [6, 11, 3], [1, 1, 1], [20, 2]]  # row 2: nothing to train
  docs = [[rng.integers(1, VOCAB, size=n).astype(np.int32) for n in row] for row in rows]
  batch = naive_rows(docs, SEQ_LEN)
  seg = batch["segment_ids"]
  batch["segment_sources"] = np.where(seg > 0, seg % 2, -1).astype(np.int32)
  return {k: jnp.asarray(v) for k, v in batch.items()}


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _worst(got, want):
  return max(_rel(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _recording(tx):
  """`tx` after a transformation that keeps the step's gradients (before clipping) as its
  state: the step's own gradients come back in `opt_state[0]`."""
  keep = optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda grads, state, params=None: (grads, grads))
  return optax.chain(keep, tx)


def _close_states(got, want):
  """The new parameters and Adam's first moment within RTOL, the second moment (squared
  gradients, so twice the gradients' relative error) within 2 * RTOL."""
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(got)),
                          jax.tree.leaves(jax.device_get(want))):
    name = jax.tree_util.keystr(path)
    assert _rel(g, w) <= (2 * RTOL if ".nu" in name else RTOL), name


CASES = {  # tied, weighting, micro-batches, sources, block size, vocabulary chunk
    "untied_token_accumulation_sources": (False, "token", 2, 2, 9, 0),
    "tied_sequence_chunks": (True, "sequence", 1, 0, 16, 50),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_blocked_step_equals_the_full_logits_step(name):
  """Block sizes 9 and 16 do not divide the 112 positions, chunks of 50 not V=211."""
  tied, weighting, accum, sources, block, chunk = CASES[name]
  graphdef, params = _model(tied)
  batch = _batch()
  if not sources:
    batch = {k: v for k, v in batch.items() if k != "segment_sources"}
  tx, schedule = steps_lib.make_optimizer(packed.get_config("smoke").train)
  tx = _recording(tx)
  state = dict(params=params, opt_state=tx.init(params), step=jnp.int32(0))

  def step(block, chunk):
    objective = TokenObjective(weighting=weighting, blocks=(block, chunk),
                               source_names=tuple(f"s{i}" for i in range(sources)))
    return jax.jit(steps_lib.make_train_step(graphdef, tx, schedule, accum=accum,
                                             objective=objective))(state, batch)

  (want_state, want_metrics), (got_state, got_metrics) = step(0, 0), step(block, chunk)
  assert float(want_metrics["loss"]) > 1.0
  for key, value in want_metrics.items():
    assert _rel(got_metrics[key], value) <= RTOL, key  # measured: at most 2e-7
  grads = (got_state["opt_state"][0], want_state["opt_state"][0])
  assert _worst(*grads) <= RTOL  # measured: at most 5.1e-7
  _close_states(got_state, want_state)


def test_the_blocked_eval_step_equals_the_full_one():
  graphdef, params = _model(False)
  batch = _batch()
  want = jax.jit(steps_lib.make_eval_step(
      graphdef, objective=TokenObjective(weighting="sequence")))(params, batch)
  got = jax.jit(steps_lib.make_eval_step(graphdef, objective=TokenObjective(
      weighting="sequence", blocks=(13, 40))))(params, batch)
  assert got["count"] == want["count"] and got["trained_tokens"] == want["trained_tokens"]
  assert _rel(got["loss_sum"], want["loss_sum"]) <= RTOL


MESH_CASES = {
    # V=128 over tensor=2 (64 per device, in chunks of 24).
    "data_fsdp_tensor_tied_sequence": {
        "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "model.tie_embeddings": True,
        "loss.weighting": "sequence", "loss.vocab_block_size": 24},
    # V=128 over tensor=4, the slots over context=2, every layer rematerialised.
    "context_tensor4_remat": {"mesh.data": 1, "mesh.context": 2, "mesh.tensor": 4,
                              "model.remat": "full"},
}


def _run(tmp_path, **overrides):
  config = synthetic_config(**{
      "model.num_layers": 1, "model.dtype": "float32", "model.vocab_size": 128,
      "attention.implementation": "xla", "attention.self_check": False,
      "train.eval_every": 0, "train.log_batches": False, **overrides})
  return setup_lib.setup(config, str(tmp_path))


def _full_step(config, mesh):
  """The trainer's step of `config` with the full logits and no remat, on `mesh`."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.model.remat = "none"
  t = config.train
  graphdef = nnx.split(nnx.eval_shape(lambda: model_lib.build(
      config, t.seed, vocab_size=config.model.vocab_size, mesh=mesh)))[0]
  tx, schedule = steps_lib.make_optimizer(t)
  return jax.jit(steps_lib.make_train_step(
      graphdef, tx, schedule, accum=t.grad_accum_steps,
      objective=TokenObjective(weighting=config.loss.weighting)))


def _primitives(jaxpr):
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


@pytest.mark.parametrize("name", list(MESH_CASES))
def test_on_the_explicit_mesh_the_blocked_step_equals_the_full_one(tmp_path, name):
  """The run's own step (`train.setup.setup` with `loss.block_size=7`) against the step of the
  same config with the full logits (and no remat), from the same state and batch."""
  run = _run(tmp_path, **MESH_CASES[name], **{"loss.block_size": 7})
  batch = sharding_lib.global_batch(data_lib.next_batch(run.iterator), run.mesh)
  traced = [_full_step(run.config, run.mesh).trace(run.state, batch),
            run.train_step.trace(run.state, batch)]
  # the blocked loss's logsumexp over the devices' shares of the vocabulary: the keys reached it
  assert "pmax" not in _primitives(traced[0].jaxpr) and "pmax" in _primitives(traced[1].jaxpr)
  want_state, want_metrics = traced[0].lower().compile()(run.state, batch)
  got_state, got_metrics = traced[1].lower().compile()(run.state, batch)  # donates the state
  for key, value in want_metrics.items():
    assert _rel(got_metrics[key], value) <= RTOL, key  # measured: at most 2e-7
  for got, sharding in zip(jax.tree.leaves(got_state), jax.tree.leaves(run.state_shardings)):
    assert got.sharding.is_equivalent_to(sharding, got.ndim)  # the tensor split kept
  _close_states(got_state, want_state)

"""`model.remat`: each decoder layer under its rematerialisation policy, the same step.

The policies ("none", "full", "dots") must give the same loss, metrics and new state (float32,
within 1e-6); the traced gradient holds one rematerialised call per layer with the policy's
saving rule, and the program handed to XLA recomputes the layers' matmuls in the backward pass
("full" more than "dots", which keeps the projections' outputs). XLA on the CPU removes the
recomputation again before it compiles (its optimisation barriers are expanded and the copies
merged), so the memory the policies save shows on GPUs and TPUs only; it is not asserted here.
A bad value is refused in one line naming the key and the value.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import packed
from support.packing_oracles import naive_rows
from train import config_checks
from train import model as model_lib
from train import train as train_lib

LAYERS = 2
POLICIES = {"full": "nothing_saveable", "dots": "DotsSaveable(only_if_no_batch_dims=True)"}


@functools.lru_cache(maxsize=None)
def _model(remat):
  cfg = model_lib.DecoderConfig(vocab_size=64, num_layers=LAYERS, d_model=32, num_heads=4,
                                num_kv_heads=2, head_dim=8, d_ff=48, init_std=0.2,
                                attention_implementation="xla", dtype="float32", remat=remat)
  return nnx.split(model_lib.Decoder(cfg, rngs=nnx.Rngs(params=0)))


@functools.lru_cache(maxsize=None)
def _batch():
  rng = np.random.default_rng(0)
  docs = [[rng.integers(1, 64, size=n).astype(np.int32) for n in row]
          for row in ([9, 4, 15], [6, 11, 3], [20, 2], [27])]
  return {k: jnp.asarray(v) for k, v in naive_rows(docs, 28).items()}


def _step(remat):
  graphdef, params = _model(remat)
  tx, schedule = train_lib.make_optimizer(packed.get_config("smoke").train)
  state = dict(params=params, opt_state=tx.init(params), step=jnp.int32(0))
  step = train_lib.make_train_step(graphdef, tx, schedule, accum=2, weighting="sequence")
  return jax.jit(step)(state, _batch())


def test_the_policies_give_the_same_step():
  want_state, want_metrics = jax.device_get(_step("none"))
  assert float(want_metrics["loss"]) > 1.0
  for remat in POLICIES:
    state, metrics = jax.device_get(_step(remat))
    for key, value in want_metrics.items():
      np.testing.assert_allclose(metrics[key], value, rtol=1e-6, err_msg=f"{remat} {key}")
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=remat)


def _loss_grad(remat):
  graphdef, params = _model(remat)
  batch = _batch()

  def loss(p):
    return jnp.sum(nnx.merge(graphdef, p).batch_logits(batch) ** 2)

  return jax.grad(loss), params


def _remat_policies(jaxpr):
  """The policy of every rematerialised call in `jaxpr` and the programs inside it."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("remat2", "checkpoint"):
      policy = eqn.params.get("policy")
      found.append(getattr(policy, "__name__", repr(policy)))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _remat_policies(sub)
  return found


def test_each_layer_runs_under_its_policy_and_the_backward_pass_recomputes():
  dots = {}
  for remat in ("none", "full", "dots"):
    grad, params = _loss_grad(remat)
    policies = _remat_policies(jax.make_jaxpr(grad)(params).jaxpr)
    assert policies == ([] if remat == "none" else [POLICIES[remat]] * LAYERS), remat
    text = jax.jit(grad).lower(params).as_text()
    dots[remat] = len(re.findall(r"stablehlo\.dot_general", text))
    assert (text.count("optimization_barrier") > 0) == (remat != "none"), remat
  assert dots["none"] < dots["dots"] < dots["full"], dots


@pytest.mark.parametrize("value", ["all", "None", ""])
def test_a_bad_remat_is_refused_naming_the_key_and_the_value(value):
  config = packed.get_config("smoke")
  config.model.remat = value
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_config(config)
  assert str(e.value) == f"model.remat must be one of ['none', 'full', 'dots'], got {value!r}"
  with pytest.raises(model_lib.ModelConfigError,
                     match=re.escape(f"DecoderConfig.remat must be one of ['none', 'full', "
                                     f"'dots'], got {value!r}")):
    model_lib.DecoderConfig(vocab_size=8, remat=value, attention_implementation="xla")

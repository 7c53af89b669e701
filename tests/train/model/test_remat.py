"""`model.remat`: each decoder layer under its rematerialisation policy, the same loss and gradients.

The policies ("none", "full", "dots") must give the same loss and gradients (float32, within
1e-6); the traced gradient holds one rematerialised call per layer with the policy's
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
from segpack import loss as loss_lib
from support.packing_oracles import naive_rows
from train import config_checks
from train.model import head_loss
from train.model import config as model_config
from train.model import decoder as model_lib

LAYERS = 2
POLICIES = {"full": "nothing_saveable", "dots": "DotsSaveable(only_if_no_batch_dims=True)"}


@pytest.fixture(autouse=True)
def _optimized_cpu_code():
  """Compiles as a user's CPU run does (tests/conftest.py turns LLVM's optimizations off
  elsewhere): the policies' gradients are compared closer (1e-9 absolute) than unoptimised CPU
  code rounds them alike (3e-8 apart)."""
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


@functools.lru_cache(maxsize=None)
def _model(remat):
  cfg = model_config.DecoderConfig(vocab_size=64, num_layers=LAYERS, d_model=32, num_heads=4,
                                num_kv_heads=2, head_dim=8, d_ff=48, init_std=0.2,
                                attention_implementation="xla", dtype="float32", remat=remat)
  return nnx.split(model_lib.Decoder(cfg, rngs=nnx.Rngs(params=0)))


@functools.lru_cache(maxsize=None)
def _batch():
  rng = np.random.default_rng(0)
  docs = [[rng.integers(1, 64, size=n).astype(np.int32) for n in row]
          for row in ([9, 4, 15], [6, 11, 3], [20, 2], [27])]
  return {k: jnp.asarray(v) for k, v in naive_rows(docs, 28).items()}


def _loss_grad(remat):
  """The trainer's loss of the batch (sequence weighting, `train.model.head_loss`) and its gradient
  w.r.t. the parameters, as a function of the parameters."""
  graphdef, params = _model(remat)
  batch = _batch()
  total = loss_lib.loss_normalizer(batch["labels"], weighting="sequence",
                                   segment_ids_BxS=batch["segment_ids"])

  def loss(p):
    token_loss = head_loss.token_losses(nnx.merge(graphdef, p), batch, block_size=0)
    return loss_lib.token_loss_sum(token_loss, batch["labels"], weighting="sequence",
                                   segment_ids_BxS=batch["segment_ids"])[0] / total

  return jax.value_and_grad(loss), params


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


def test_the_policies_give_the_same_loss_and_gradients_and_rematerialise_each_layer():
  """Per policy: the traced gradient's rematerialised calls, the recomputation in the program
  handed to XLA (`optimization_barrier`s and more matmuls), then the loss and the gradients,
  equal to those without remat (the whole step with remat runs in
  tests/train/test_head_loss.py, on the mesh)."""
  dots, results = {}, {}
  for remat in ("none", "full", "dots"):
    value_and_grad, params = _loss_grad(remat)
    policies = _remat_policies(jax.make_jaxpr(value_and_grad)(params).jaxpr)
    assert policies == ([] if remat == "none" else [POLICIES[remat]] * LAYERS), remat
    lowered = jax.jit(value_and_grad).lower(params)
    text = lowered.as_text()
    dots[remat] = len(re.findall(r"stablehlo\.dot_general", text))
    assert (text.count("optimization_barrier") > 0) == (remat != "none"), remat
    results[remat] = jax.device_get(lowered.compile()(params))
  assert dots["none"] < dots["dots"] < dots["full"], dots
  assert float(results["none"][0]) > 1.0
  for remat in POLICIES:
    for got, want in zip(jax.tree.leaves(results[remat]), jax.tree.leaves(results["none"])):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=remat)


@pytest.mark.parametrize("value", ["all", "None", ""])
def test_a_bad_remat_is_refused_naming_the_key_and_the_value(value):
  config = packed.get_config("smoke")
  config.model.remat = value
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_config(config)
  assert str(e.value) == f"model.remat must be one of ['none', 'full', 'dots'], got {value!r}"
  with pytest.raises(model_config.ModelConfigError,
                     match=re.escape(f"DecoderConfig.remat must be one of ['none', 'full', "
                                     f"'dots'], got {value!r}")):
    model_config.DecoderConfig(vocab_size=8, remat=value, attention_implementation="xla")

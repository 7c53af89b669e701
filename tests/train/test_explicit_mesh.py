"""The trainer on its mesh of explicit axes (`jax.make_mesh`'s default) on 8 CPU devices.

Every parallelism the config offers (data, fsdp, tensor, context, gradient accumulation; XLA and
Pallas-interpret attention; tied embeddings, q/k/v biases, q/k norms; both loss weightings;
per-source losses) must give one training step's loss, metrics and updated parameters and
optimizer state of one device running the same step on the same batch in row order, to float
tolerance. The state, the batch and every array of the step are typed with the mesh's explicit
shardings (the partitioner does not choose them), and the updated state keeps the shardings of
`train.sharding` (the ZeRO-3 gathers transpose back into the parameters' splits).
"""

import os
import subprocess
import sys

from support import hf_models
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from support.paths import REPO
from support.train_configs import synthetic_config

from configs import packed
from train import context_batches as context_lib
from train import data as data_lib
from train.hf import export as export_lib
from train.hf import config as hf_config
from train import layout as layout_lib
from train import metrics as metrics_lib
from train import model as model_lib
from train import sharding as sharding_lib
from train import train as train_lib

EXPLICIT = AxisType.Explicit
NUM_SOURCES = 2  # the "sources" cases' per-source losses: each slot's source is its segment % 2


def _config(**overrides):
  """A tiny float32 synthetic run: E=32, H=4, K=2, D=8, F=64, V=128 (splits over 2 and 4)."""
  return synthetic_config(**{"model.num_layers": 2, "model.dtype": "float32",
                       "model.vocab_size": 128, "attention.implementation": "xla",
                       "attention.self_check": False, "train.eval_every": 0,
                       "train.log_batches": False, **overrides})


CASES = {
    "data8": {},
    "data_fsdp_tensor": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
    "fsdp8": {"mesh.data": 1, "mesh.fsdp": 8},
    # K=2 does not divide over 4: the heads stay whole, F=64 and V=128 split over 4.
    "tensor4": {"mesh.data": 2, "mesh.tensor": 4},
    "context_tensor": {"mesh.data": 2, "mesh.context": 2, "mesh.tensor": 2},
    "context4_fsdp": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 4},
    "accumulation": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                     "train.batch_size": 16, "train.grad_accum_steps": 2},
    # fsdp=1: the micro-batch reshape must keep the one-device axis on the rows.
    "accumulation_data8": {"train.batch_size": 16, "train.grad_accum_steps": 2},
    "tied_bias_norm_sequence": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                                "model.tie_embeddings": True, "model.qkv_bias": True,
                                "model.qk_norm": True, "loss.weighting": "sequence"},
    "sources_context_accumulation": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 2,
                                     "mesh.tensor": 2, "train.batch_size": 16,
                                     "train.grad_accum_steps": 2, "loss.weighting": "sequence"},
    "pallas": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
               "attention.implementation": "pallas", "attention.interpret": True},
    "pallas_context": {"mesh.data": 2, "mesh.context": 2, "mesh.tensor": 2,
                       "attention.implementation": "pallas", "attention.interpret": True},
}


def _with_sources(batch):
  """The batch with `segment_sources` (segment id % 2, -1 on padding), as a mixture's rows."""
  seg = np.asarray(batch["segment_ids"])
  return dict(batch, segment_sources=np.where(seg > 0, seg % NUM_SOURCES, -1).astype(np.int32))


def _step(config, mesh, state, batch, *, num_sources):
  """One jitted train step of `config` on `mesh` (None: one device, no mesh)."""
  t = config.train
  graphdef = nnx.split(nnx.eval_shape(lambda: model_lib.build(
      config, t.seed, vocab_size=config.model.vocab_size, mesh=mesh)))[0]
  tx, schedule = train_lib.make_optimizer(t)
  step = train_lib.make_train_step(graphdef, tx, schedule, accum=t.grad_accum_steps,
                                   weighting=config.loss.weighting, num_sources=num_sources)
  return jax.jit(step)(state, batch)


def _assert_explicit(tree, mesh):
  for leaf in jax.tree.leaves(tree):
    sharding = jax.typeof(leaf).sharding
    assert sharding.mesh.axis_types == (EXPLICIT,) * 4, sharding
    assert dict(sharding.mesh.shape) == dict(mesh.shape)


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_on_the_explicit_mesh_equals_one_device(tmp_path, name):
  overrides = CASES[name]
  config = _config(**overrides)
  run = train_lib.setup(config, str(tmp_path))
  assert run.mesh.axis_types == (EXPLICIT,) * 4
  sizes = {k.split(".")[1]: v for k, v in overrides.items() if k.startswith("mesh.")}
  assert all(run.mesh.shape[axis] == size for axis, size in sizes.items())
  num_sources = NUM_SOURCES if name.startswith("sources") else 0
  local = data_lib.next_batch(run.iterator)  # in context order with mesh.context > 1
  if num_sources:
    local = _with_sources(local)
  before = jax.device_get(run.state)
  batch = sharding_lib.global_batch(local, run.mesh)
  _assert_explicit([batch, run.state], run.mesh)
  state, metrics = _step(config, run.mesh, run.state, batch, num_sources=num_sources)
  _assert_explicit([state, metrics], run.mesh)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(run.state_shardings)):
    assert got.sharding.is_equivalent_to(want, got.ndim)  # the fsdp / tensor splits are kept
  want_state, want_metrics = _step(config, None, before, context_lib.row_order(local),
                                   num_sources=num_sources)
  assert float(metrics["finite"]) == 1.0 and float(want_metrics["loss"]) > 1.0
  for key, value in want_metrics.items():
    # Measured: at most 2e-7 relative (summation order).
    np.testing.assert_allclose(np.asarray(metrics[key]), np.asarray(value), rtol=2e-6,
                               atol=1e-7, err_msg=key)
  for got, want in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)  # measured: 2.1e-9 absolute


def test_the_trainers_mesh_has_explicit_axes():
  """`train.sharding.make_mesh` builds what `jax.make_mesh` makes by default, also over a
  subset of the devices."""
  assert set(jax.make_mesh((8,), ("data",)).axis_types) == {EXPLICIT}
  mesh = sharding_lib.make_mesh(data=2, fsdp=2, tensor=2)
  assert mesh.axis_types == (EXPLICIT,) * 4 and mesh.axis_names == sharding_lib.AXES
  one = sharding_lib.make_mesh(data=1, devices=jax.devices()[:1])
  assert one.axis_types == (EXPLICIT,) * 4 and one.devices.size == 1


def test_the_decoder_names_every_split_and_computes_what_it_computes_elsewhere():
  """On the 2 x 2 x 2 mesh: activations are split by rows only, q/k/v and the feed-forward
  hidden by `tensor` (the kernels stay stored over `fsdp`), and the logits leave with the
  vocabulary whole; they equal the logits without a mesh and on a mesh of `Auto` axes (the
  plain Flax modules, shardings left to the partitioner)."""
  config = _config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
  mesh = sharding_lib.make_mesh(data=2, fsdp=2, tensor=2)
  graphdef, params = nnx.split(model_lib.build(config, 0, vocab_size=128, mesh=mesh))
  rng = np.random.default_rng(0)
  seg = np.sort(rng.integers(0, 4, size=(8, 64)), axis=1).astype(np.int32)
  host = (rng.integers(0, 128, size=(8, 64)).astype(np.int32), seg,
          np.tile(np.arange(64, dtype=np.int32), (8, 1)))
  seen = {}

  def run(p, ids_BxS, seg_BxS, pos_BxS):
    m = nnx.merge(graphdef, p)
    if layout_lib.layout_of(ids_BxS) is not None:
      x_BxSxE = m.embed_tokens(ids_BxS)
      layout = layout_lib.layout_of(x_BxSxE)
      seen["x"] = jax.typeof(x_BxSxE).sharding.spec
      angles = jnp.zeros((8, 64, 4), jnp.float32)
      seen["q"] = jax.typeof(m.layers[0].attn.qkv(x_BxSxE, angles)[0]).sharding.spec
      hidden = layout_lib.dense(m.layers[0].mlp.gate, x_BxSxE, layout, split_out="tensor")
      seen["h"] = jax.typeof(hidden).sharding.spec
      seen["kernel"] = jax.typeof(m.layers[0].mlp.gate.kernel[...]).sharding.spec
    return m(ids_BxS, segment_ids=seg_BxS, segment_positions=pos_BxS)

  def on(mesh_):
    placed = jax.device_put(params, sharding_lib.param_shardings(params, mesh_))
    batch = jax.device_put(host, sharding_lib.batch_sharding(mesh_))
    return jax.jit(run)(placed, *batch)

  logits = on(mesh)
  batch = (("data", "fsdp"), "context")
  assert seen == dict(x=P(*batch, None), q=P(*batch, "tensor", None), h=P(*batch, "tensor"),
                      kernel=P("fsdp", "tensor"))
  assert jax.typeof(logits).sharding.spec == P(*batch, None)
  auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * 4)
  want = jax.jit(run)(jax.device_get(params), *host)  # one device, no mesh
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(on(auto)), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_decoder_placed_on_the_mesh_takes_unplaced_rows():
  """Parameters placed on the 2 x 2 x 2 mesh (as `hf_weights.load_decoder` places them), a NumPy
  row that does not split over the rows' 4 devices: eagerly, under `jax.set_mesh`, and with the
  parameters as `jit` arguments, the logits equal the unplaced model's."""
  config = _config()
  mesh = sharding_lib.make_mesh(data=2, fsdp=2, tensor=2)
  graphdef, params = nnx.split(model_lib.build(config, 0, vocab_size=128, mesh=mesh))
  rng = np.random.default_rng(1)
  row = dict(input_ids=rng.integers(0, 128, size=(1, 64)).astype(np.int32),
             segment_ids=np.repeat(np.arange(1, 5, dtype=np.int32), 16)[None],
             segment_positions=np.tile(np.arange(16, dtype=np.int32), 4)[None])
  want = np.asarray(nnx.merge(graphdef, params).batch_logits(row))
  placed = jax.device_put(params, sharding_lib.param_shardings(params, mesh))
  model = nnx.merge(graphdef, placed)
  with jax.set_mesh(mesh):
    in_context = jax.jit(model.batch_logits)(row)
  as_args = jax.jit(lambda p, r: nnx.merge(graphdef, p).batch_logits(r))(placed, row)
  for got in (model.batch_logits(row), in_context, as_args):
    assert layout_lib.mesh_of(got) is not None
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def _tensors(directory):
  from safetensors.numpy import load_file  # optional: the hf extra
  out = {}
  for name in sorted(os.listdir(directory)):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(directory, name)))
  return out


@pytest.mark.slow
def test_hf_import_training_resume_and_export_on_explicit_meshes(tmp_path):
  """A Qwen2 checkpoint (q/k/v biases) is read slice by slice onto data x fsdp x tensor = 2 x 2
  x 2 (`make_array_from_callback` on the explicit shardings), trained 2 steps, resumed on fsdp=8
  for a third, evaluated and exported: the losses, the held-out loss and the exported tensors
  are those of the same 3 steps on data=8."""
  pytest.importorskip("transformers")
  pytest.importorskip("torch")
  model_dir = hf_models.make_tokenizer(hf_models.make_model(str(tmp_path / "m"), "qwen2"))
  hf_models.write_text_jsonl(str(tmp_path / "docs.jsonl"), 60, seed=4)
  tokenize = subprocess.run(
      [sys.executable, "-m", "segpack", "tokenize", "--input", str(tmp_path / "docs.jsonl"),
       "--tokenizer", f"hf:{model_dir}", "--output", str(tmp_path / "data")],
      cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
      timeout=600)
  assert tokenize.returncode == 0, tokenize.stderr[-2000:]

  def train(workdir, steps, **mesh):
    config = packed.get_config()
    config.model.init_from = model_dir
    config.data.train = str(tmp_path / "data")
    config.packing.seq_len = 64
    hf_config.adopt(config)
    config.attention.implementation, config.attention.self_check = "xla", False
    config.train.update(batch_size=8, num_steps=steps, warmup_steps=1, log_every=1,
                        eval_every=3, eval_batches=1, checkpoint_every=2, log_batches=False)
    config.mesh.update(mesh)
    return train_lib.train_and_evaluate(config, str(workdir))

  train(tmp_path / "a", 3, data=8)
  train(tmp_path / "b", 2, data=2, fsdp=2, tensor=2)
  assert train(tmp_path / "b", 3, data=1, fsdp=8)["resumed_from"] == 2
  records = {run: metrics_lib.read(tmp_path / run) for run in "ab"}
  for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "eval_loss")):
    got, want = ({r["step"]: r[key] for r in records[run] if r["kind"] == kind} for run in "ba")
    assert set(want) <= set(got) and 3 in want, (kind, got, want)  # b also evaluates at 2
    np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)],
                               rtol=2e-5, err_msg=key)
  for run in "ab":
    export_lib.export(workdir=str(tmp_path / run), output=str(tmp_path / f"{run}_hf"))
  got, want = _tensors(tmp_path / "b_hf"), _tensors(tmp_path / "a_hf")
  assert sorted(got) == sorted(want) and "model.layers.0.self_attn.q_proj.bias" in got
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6, err_msg=name)

"""The decoder and an imported Hugging Face checkpoint placed on the trainer's mesh of explicit
axes (`jax.make_mesh`'s default) on 8 CPU devices.

The decoder names every split of its activations and computes the logits it computes without a
mesh; parameters placed on the mesh take unplaced rows; a Qwen2 checkpoint read slice by slice
onto a 2 x 2 x 2 mesh, trained, resumed on another mesh and exported gives the losses and tensors
of the same steps on one data-parallel mesh. (One training step per parallelism against one
device: tests/train/test_explicit_mesh.py.)
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
from train.export import command as export_lib
from train.hf import config as hf_config
from train.model import layout as layout_lib
from train import metrics as metrics_lib
from train.model import decoder as model_lib
from train import sharding as sharding_lib
from train import train as train_lib


def _config(**overrides):
  """A tiny float32 synthetic run: E=32, H=4, K=2, D=8, F=64, V=128 (splits over 2 and 4)."""
  return synthetic_config(**{"model.num_layers": 2, "model.dtype": "float32",
                       "model.vocab_size": 128, "attention.implementation": "xla",
                       "attention.self_check": False, "train.eval_every": 0,
                       "train.log_batches": False, **overrides})


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

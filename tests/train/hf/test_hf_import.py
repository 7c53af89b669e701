"""Importing Hugging Face checkpoints: segpack's logits on packed rows equal transformers' logits
of each document run alone (torch on the CPU, float32), for every family, tied and untied, with
1, 2 or all KV heads; RoPE scaling past the original context; a wrong RoPE layout is caught."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from support import hf_models  # noqa: E402
from support.packing_oracles import naive_rows  # noqa: E402
from configs import packed  # noqa: E402
from train.hf import config as hf_config, weights as hf_weights  # noqa: E402
from train import sharding as sharding_lib  # noqa: E402

ATOL = 1e-4


def _imported(model_dir, **overrides):
  config = packed.get_config()
  config.model.init_from = model_dir
  config.attention.implementation = "xla"
  hf_config.adopt(config)
  for key, value in overrides.items():
    config.model[key] = value
  mesh = sharding_lib.make_mesh()
  return config, hf_weights.load_decoder(config, mesh=mesh)


def _packed_logits(model, docs, seq_len):
  row = {k: jnp.asarray(v) for k, v in naive_rows([docs], seq_len).items()}
  return np.asarray(model(row["input_ids"], segment_ids=row["segment_ids"],
                          segment_positions=row["segment_positions"]))[0]


def _worst_error(model_dir, model, docs, seq_len):
  packed_logits = _packed_logits(model, docs, seq_len)
  worst, start = 0.0, 0
  for doc in docs:
    alone = hf_models.transformers_logits(model_dir, doc)
    worst = max(worst, float(np.abs(packed_logits[start:start + len(doc)] - alone).max()))
    start += len(doc)
  return worst


CASES = [(family, tie, kv) for family in hf_models.FAMILIES for tie in (False, True)
         for kv in (1, 2, 4)]


@pytest.mark.parametrize("family,tie,kv_heads", CASES)
def test_packed_row_logits_equal_transformers_per_document(tmp_path, family, tie, kv_heads):
  model_dir = hf_models.make_model(str(tmp_path / "m"), family, tie=tie, kv_heads=kv_heads)
  config, model = _imported(model_dir)
  assert config.model.family == family and config.model.num_kv_heads == kv_heads
  assert config.model.tie_embeddings == tie
  docs = hf_models.documents(3, lengths=[300, 150, 70], seed=1)  # 520 of 544 slots
  assert _worst_error(model_dir, model, docs, seq_len=544) <= ATOL


def test_llama3_scaling_is_checked_past_the_original_context(tmp_path):
  rope = dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=64)
  model_dir = hf_models.make_model(str(tmp_path / "m"), "llama", rope=rope)
  config, model = _imported(model_dir)
  assert config.model.rope_scaling.type == "llama3"
  docs = hf_models.documents(3, lengths=[400, 64, 60], seed=2)  # 400 >> 64 original positions
  assert _worst_error(model_dir, model, docs, seq_len=530) <= ATOL
  # Negative control: the same weights without the scaling are far off past position 64.
  config.model.rope_scaling.type = None
  unscaled = hf_weights.load_decoder(config, mesh=sharding_lib.make_mesh())
  assert _worst_error(model_dir, unscaled, docs, seq_len=530) > 100 * ATOL


def test_linear_scaling(tmp_path):
  rope = dict(rope_type="linear", rope_theta=10_000.0, factor=4.0)
  model_dir = hf_models.make_model(str(tmp_path / "m"), "llama", rope=rope)
  config, model = _imported(model_dir)
  assert (config.model.rope_scaling.type, config.model.rope_scaling.factor) == ("linear", 4.0)
  docs = hf_models.documents(3, lengths=[300, 120, 90], seed=3)
  assert _worst_error(model_dir, model, docs, seq_len=512) <= ATOL


def _interleave_permutation(num_heads, head_dim):
  """Row order that turns the rotate-half layout into interleaved pairs (what a converter for
  an interleaved-RoPE model would apply); applying it to a rotate-half model is the classic bug."""
  half = head_dim // 2
  per_head = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
  return np.concatenate([h * head_dim + per_head for h in range(num_heads)])


def test_a_wrong_rope_layout_fails_the_comparison(tmp_path):
  import torch
  from safetensors.torch import load_file, save_file
  model_dir = hf_models.make_model(str(tmp_path / "m"), "llama", kv_heads=2)
  _, model = _imported(model_dir)
  docs = hf_models.documents(3, lengths=[300, 150, 70], seed=1)
  assert _worst_error(model_dir, model, docs, seq_len=544) <= ATOL
  broken = str(tmp_path / "broken")
  os.makedirs(broken)
  for name in ("config.json", "generation_config.json"):
    with open(os.path.join(model_dir, name), "rb") as f, \
         open(os.path.join(broken, name), "wb") as g:
      g.write(f.read())
  tensors = load_file(os.path.join(model_dir, "model.safetensors"))
  for name in list(tensors):
    for proj, heads in (("q_proj", hf_models.HEADS), ("k_proj", 2)):
      if name.endswith(f"{proj}.weight"):
        perm = torch.as_tensor(_interleave_permutation(heads, hf_models.HEAD_DIM))
        tensors[name] = tensors[name][perm].contiguous()
  save_file(tensors, os.path.join(broken, "model.safetensors"), metadata={"format": "pt"})
  _, wrong = _imported(broken)
  assert _worst_error(model_dir, wrong, docs, seq_len=544) > 100 * ATOL


def test_sharded_checkpoint_and_bfloat16_weights(tmp_path):
  model_dir = hf_models.make_model(str(tmp_path / "m"), "qwen2", dtype="bfloat16",
                                   max_shard_size="40KB")
  assert os.path.isfile(os.path.join(model_dir, hf_weights.INDEX_NAME))
  config, model = _imported(model_dir)
  assert config.model.param_dtype == "bfloat16"
  config_f32, model_f32 = _imported(model_dir, param_dtype="float32")
  params = {sharding_lib.param_name(p): np.asarray(x) for p, x in _leaves(model_f32)}
  from safetensors.numpy import load_file
  import glob
  stored = {}
  for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
    stored.update(load_file(path))
  for ours, tensor in hf_weights.model_tensor_map(config_f32.model).items():
    want = stored[tensor.name].astype(np.float32)
    np.testing.assert_array_equal(params[ours], want.T if tensor.transpose else want)


def _leaves(model):
  import jax
  from flax import nnx
  out = []
  jax.tree_util.tree_map_with_path(lambda p, x: out.append((p, x)), nnx.split(model)[1])
  return out


def test_a_float16_checkpoint_trains_with_float32_master_weights(tmp_path):
  """float16 parameters overflow in AdamW's first updates (the run stopped at step 1 as not
  finite): a float16 checkpoint's weights are imported as float32, exactly, unless
  model.param_dtype is given."""
  model_dir = hf_models.make_model(str(tmp_path / "m"), "llama", dtype="float16")
  config, model = _imported(model_dir)
  assert config.model.param_dtype == "float32"
  from safetensors.numpy import load_file
  stored = load_file(os.path.join(model_dir, "model.safetensors"))
  params = {sharding_lib.param_name(p): np.asarray(x) for p, x in _leaves(model)}
  table = params["embed/embedding"]
  assert table.dtype == np.float32
  np.testing.assert_array_equal(table, stored["model.embed_tokens.weight"].astype(np.float32))
  config16, _ = _imported(model_dir, param_dtype="float16")  # given: kept
  assert config16.model.param_dtype == "float16"

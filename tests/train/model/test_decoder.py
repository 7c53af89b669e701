"""Proofs that the decoder on packed rows is exactly the decoder on each document alone.

The oracle is always a per-document run of the same model (a row holding only that document),
never the packed code path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support.packing_oracles import naive_rows
from segpack import loss as loss_lib
from segpack.attention import PallasOptions
from train.model import config as model_config
from train.model import decoder as model_lib

VOCAB = 67


def _tiny(**overrides):
  kw = dict(vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
            d_ff=48, init_std=0.2)
  kw.update(overrides)
  return model_lib.Decoder(model_config.DecoderConfig(**kw), rngs=nnx.Rngs(params=0))


def _pack(docs_per_row, seq_len):
  return {k: jnp.asarray(v) for k, v in naive_rows(docs_per_row, seq_len).items()}


def _docs(seed, lengths):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, VOCAB, size=n).astype(np.int32) for n in lengths]


@nnx.jit
def _run(model, batch):
  return model(batch["input_ids"], segment_ids=batch["segment_ids"],
               segment_positions=batch["segment_positions"])


def test_packed_logits_equal_each_document_alone():
  model = _tiny()
  docs = _docs(0, [7, 13, 1, 17, 5, 9, 31])
  rows = [[docs[0], docs[1], docs[2]], [docs[3], docs[4], docs[5]], [docs[6]]]
  seq_len = 32
  packed = _run(model, _pack(rows, seq_len))
  worst = 0.0
  for r, row_docs in enumerate(rows):
    pos = 0
    for doc in row_docs:
      alone = _run(model, _pack([[doc]], len(doc)))[0]
      diff = np.max(np.abs(np.asarray(packed[r, pos:pos + len(doc)]) - np.asarray(alone)))
      worst = max(worst, float(diff))
      pos += len(doc)
  assert worst <= 1e-5, worst


def test_positions_matter():
  """Sanity of the oracle: shifting a document's positions changes its logits (RoPE is live)."""
  model = _tiny()
  doc = _docs(1, [12])[0]
  batch = _pack([[doc]], 12)
  # A uniform shift would not change relative RoPE; positions that do not restart do.
  shifted = dict(batch, segment_positions=batch["segment_positions"] * 2)
  diff = np.max(np.abs(np.asarray(_run(model, batch)) - np.asarray(_run(model, shifted))))
  assert diff > 1e-4


def _loss_fn(params, graphdef, batch):
  model = nnx.merge(graphdef, params)
  return loss_lib.cross_entropy_loss(_run(model, batch), batch["labels"])[0]


def test_packed_loss_and_grads_are_token_weighted_per_document():
  model = _tiny()
  graphdef, params = nnx.split(model)
  docs = _docs(2, [9, 4, 15, 6, 2])
  rows = [[docs[0], docs[1], docs[2]], [docs[3], docs[4]]]
  loss_and_grad = jax.jit(jax.value_and_grad(_loss_fn), static_argnums=1)
  packed_loss, packed_grads = loss_and_grad(params, graphdef, _pack(rows, 28))

  weights = np.array([len(d) - 1 for d in docs], np.float64)  # trained tokens per document
  per_doc = [loss_and_grad(params, graphdef, _pack([[d]], len(d))) for d in docs]
  want_loss = sum(w * float(l) for w, (l, _) in zip(weights, per_doc)) / weights.sum()
  want_grads = jax.tree.map(
      lambda *gs: sum(w * g for w, g in zip(weights, gs)) / weights.sum(),
      *[g for _, g in per_doc])
  np.testing.assert_allclose(float(packed_loss), want_loss, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(packed_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


def test_no_gradient_flows_between_segments():
  model = _tiny()
  docs = _docs(3, [6, 10, 5])
  batch = _pack([docs], 24)
  seg = np.asarray(batch["segment_ids"][0])
  x_BxSxE = model.embed_tokens(batch["input_ids"])
  rng = np.random.default_rng(0)
  for target in (1, 2, 3):
    probe = jnp.asarray(rng.normal(size=(1, 24, VOCAB)).astype(np.float32)
                        * (seg == target)[None, :, None])

    def out(x):
      logits = model.from_embeddings(x, segment_ids=batch["segment_ids"],
                                     segment_positions=batch["segment_positions"])
      return jnp.sum(logits * probe)

    grad_S = np.abs(np.asarray(jax.jit(jax.grad(out))(x_BxSxE))[0]).max(axis=-1)
    assert np.all(grad_S[seg != target] == 0.0), (target, grad_S)  # exactly zero
    assert np.all(grad_S[seg == target] > 0.0)  # and live inside the segment


def test_gqa_and_tied_embeddings_build_and_run():
  model = _tiny(num_heads=6, num_kv_heads=3, tie_embeddings=True)
  batch = _pack([_docs(4, [5, 3])], 10)
  logits = _run(model, batch)
  assert logits.shape == (1, 10, VOCAB) and logits.dtype == jnp.float32
  assert not hasattr(model, "lm_head")


def test_bfloat16_compute_stays_close_to_float32():
  batch = _pack([_docs(5, [11, 7])], 20)
  f32 = np.asarray(_run(_tiny(), batch))
  bf16 = np.asarray(_run(_tiny(dtype="bfloat16"), batch))
  assert np.max(np.abs(f32 - bf16)) < 0.15 * np.max(np.abs(f32))


@pytest.mark.parametrize("overrides, match", [
    (dict(num_heads=4, num_kv_heads=3), "num_heads=4.*num_kv_heads=3"),
    (dict(head_dim=7), "head_dim.*7"),
    (dict(d_model=0), "d_model.*0"),
    (dict(dtype="fp8"), "dtype.*fp8"),
    (dict(attention_implementation="flash"), "attention.implementation.*'flash'"),
])
def test_bad_config_names_the_field(overrides, match):
  with pytest.raises(model_config.ModelConfigError, match=match):
    _tiny(**overrides)


def test_shape_mismatch_is_refused():
  model = _tiny()
  with pytest.raises(ValueError, match=r"segment_ids \(1, 4\)"):
    model(jnp.zeros((1, 5), jnp.int32), segment_ids=jnp.zeros((1, 4), jnp.int32),
          segment_positions=jnp.zeros((1, 5), jnp.int32))


def _grad_text(model, mesh, *, seq_len=256, lowering_platforms=None):
  """The lowering of the gradient of `model`'s summed logits on 8 abstract rows of `seq_len`,
  the rows sharded over the `data` and `fsdp` axes of `mesh`."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  graphdef, params = nnx.split(model)

  def loss(p, ids_BxS, seg_BxS, pos_BxS):
    logits = nnx.merge(graphdef, p)(ids_BxS, segment_ids=seg_BxS, segment_positions=pos_BxS)
    return logits.sum()

  rows = NamedSharding(mesh, P(("data", "fsdp")))
  ids = jax.ShapeDtypeStruct((8, seq_len), jnp.int32)
  return jax.jit(jax.grad(loss), in_shardings=(None, rows, rows, rows)).trace(
      params, ids, ids, ids).lower(lowering_platforms=lowering_platforms).as_text()


def test_kernel_attention_runs_per_device_on_the_trainer_mesh():
  """With Pallas attention and the trainer's mesh, the model's gradient lowers for `cuda` with the
  Triton kernels (forward, dQ, dK/dV) inside `shard_map`, not on a gathered global batch."""
  from train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  mesh = sharding_lib.make_mesh(data=4, fsdp=2, tensor=1)
  model = _tiny(num_layers=1, head_dim=64, d_model=64, num_heads=2, num_kv_heads=1,
                attention_implementation="pallas", attention_mesh=mesh)
  text = _grad_text(model, mesh, lowering_platforms=("cuda",))
  assert text.count("xla.gpu.triton") >= 3  # forward, dQ and dK/dV
  assert "sdy.manual_computation" in text  # absent when the model is built without the mesh


def _cudnn_model_cuda_text(segment_bound):
  """The `cuda` lowering of the gradient of a cuDNN-attention model built from a trainer config,
  with the data's most segments in a row `segment_bound` (the packing cap set apart)."""
  from configs import packed  # pylint: disable=g-import-not-at-top
  from train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  config = packed.get_config("smoke")
  config.packing.max_segments_per_row = 40  # the packing's cap: not the bound
  config.attention.implementation = "cudnn"
  config.model.update(num_layers=1, d_model=128, num_heads=2, num_kv_heads=1, head_dim=64,
                      dtype="bfloat16")
  mesh = sharding_lib.make_mesh(data=4, fsdp=2, tensor=1)
  model = model_lib.build(config, 0, vocab_size=VOCAB, mesh=mesh,
                          segment_bound=segment_bound)
  return model.cfg.attention_cudnn_segment_bound, _grad_text(model, mesh,
                                                             lowering_platforms=("cuda",))


def test_cudnn_attention_gets_the_data_bound_and_runs_on_the_trainer_mesh(monkeypatch):
  """`train.model.decoder.build` passes the data's most segments in a row, rounded up to a power of two,
  to cuDNN as its static bound N, and the cuDNN call (forward and backward) lowers for `cuda` per
  device inside `shard_map`.

  The CPU jaxlib cannot report a cuDNN version or a GPU's compute capability; those two host
  probes are faked (as in tests/attention/test_attention_cudnn.py), the lowering itself is JAX's.
  """
  import re  # pylint: disable=g-import-not-at-top
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
  n, text = _cudnn_model_cuda_text(12)
  assert n == 16
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  assert "__cudnn$fmhaSoftmax" in calls and "__cudnn$fmhaSoftmaxBackward" in calls
  assert "sdy.manual_computation" in text
  # One row per device (8 rows over data x fsdp): seqlens [1, N], offsets [1, N + 1] with N = 16
  # (12 rounded up); neither the packing cap (40) nor the row length (256) is used.
  assert "tensor<1x16xi32>" in text and "tensor<1x17xi32>" in text
  assert "tensor<1x41xi32>" not in text and "tensor<1x257xi32>" not in text


def test_cudnn_without_a_data_bound_is_refused():
  from configs import packed  # pylint: disable=g-import-not-at-top
  config = packed.get_config("smoke")
  config.attention.implementation = "cudnn"
  with pytest.raises(model_config.ModelConfigError, match="Data.segment_bound"):
    model_lib.build(config, 0, vocab_size=VOCAB)
  with pytest.raises(model_config.ModelConfigError, match="needs attention_cudnn_segment_bound"):
    _tiny(attention_implementation="cudnn")
  config.attention.implementation = "xla"  # the other backends need no bound and get none
  assert model_lib.build(config, 0, vocab_size=VOCAB, segment_bound=5
                         ).cfg.attention_cudnn_segment_bound is None


def test_bad_cudnn_segment_bound_is_refused():
  for bad in (0, True, 2.0):
    with pytest.raises(model_config.ModelConfigError,
                       match=f"attention_cudnn_segment_bound must be .* got {bad!r}"):
      _tiny(attention_implementation="cudnn", attention_cudnn_segment_bound=bad)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="None means XLA only off a GPU")
@pytest.mark.parametrize("overrides, match", [
    (dict(attention_implementation="xla", attention_pallas=PallasOptions(interpret=True)),
     r"`pallas`=PallasOptions\(.*\) is a Pallas setting, but implementation='xla'"),
    (dict(attention_pallas=PallasOptions(interpret=True)),
     r"but implementation=None \(here 'xla'\) does not use it"),
    (dict(attention_implementation="pallas", attention_cudnn_segment_bound=8),
     "`cudnn_segment_bound`=8 is a cuDNN setting, but implementation='pallas'"),
])
def test_a_setting_for_another_backend_is_refused(overrides, match):
  """`segpack.attention.resolve_implementation`'s rule, as a `ModelConfigError` at construction."""
  with pytest.raises(model_config.ModelConfigError, match=match):
    _tiny(**overrides)


def test_the_config_groups_the_attention_settings():
  """`attention.interpret` becomes `PallasOptions(interpret=True)`; the config keys stay."""
  from configs import packed  # pylint: disable=g-import-not-at-top
  config = packed.get_config("smoke")
  config.attention.implementation = "pallas"
  cfg = model_config.decoder_config(config.model, config.attention, vocab_size=VOCAB)
  assert cfg.attention_pallas is None and cfg.attention_cudnn_segment_bound is None
  config.attention.interpret = True
  cfg = model_config.decoder_config(config.model, config.attention, vocab_size=VOCAB)
  assert cfg.attention_pallas == PallasOptions(interpret=True)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal on a CPU")
def test_the_trainer_refuses_pallas_on_the_cpu_without_interpret_naming_the_keys():
  """`train.check_attention` applies `resolve_implementation`'s rule to the config and names
  the config keys; with `attention.interpret=True` Pallas is accepted."""
  from configs import packed  # pylint: disable=g-import-not-at-top
  from train import config_checks as train_lib  # pylint: disable=g-import-not-at-top
  config = packed.get_config("smoke")
  config.attention.implementation = "pallas"
  with pytest.raises(train_lib.AttentionConfigError) as err:
    train_lib.check_attention(config.attention, platform="cpu")
  msg = str(err.value)
  for part in ("attention.implementation='pallas'", "attention.interpret=False",
               "attention.interpret=True", "`pallas.interpret=True`", "on the CPU"):
    assert part in msg, (part, msg)
  train_lib.check_attention(config.attention, platform="gpu")  # the kernels run there
  config.attention.interpret = True
  train_lib.check_attention(config.attention, platform="cpu")
  config.attention.implementation = None  # None is XLA on the CPU, which has no interpret mode
  with pytest.raises(train_lib.AttentionConfigError, match="does not use it"):
    train_lib.check_attention(config.attention, platform="cpu")
  train_lib.check_attention(config.attention, platform="gpu")  # None is Pallas there


def test_xla_attention_gets_no_mesh():
  """The model runs XLA attention without `shard_map` even when built with a mesh (the jit
  partitioner splits it); the kernel backends get the mesh (the tests above and below)."""
  from train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  mesh = sharding_lib.make_mesh(data=4, fsdp=2, tensor=1)
  model = _tiny(num_layers=1, attention_implementation="xla", attention_mesh=mesh)
  text = _grad_text(model, mesh, seq_len=32)
  assert "sdy.manual_computation" not in text


def test_pallas_attention_on_the_trainer_mesh_matches_xla_logits_and_grads():
  """The model's kernel path (Pallas in interpret mode, per device under `shard_map` on the
  trainer's data x fsdp mesh) gives the logits and parameter gradients of the XLA reference."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  mesh = sharding_lib.make_mesh(data=4, fsdp=2, tensor=1)
  docs = _docs(6, [20, 9, 1, 33, 48, 5, 16, 40, 12, 7, 30, 2, 25])
  rows = [docs[0:3], docs[3:4], docs[4:6], docs[6:8], docs[8:11], docs[11:12], [], docs[12:13]]
  batch = _pack(rows, 64)
  batch = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp"))))

  def logits_and_grads(**overrides):
    graphdef, params = nnx.split(_tiny(num_layers=1, **overrides))
    # On the mesh, as the trainer places them: on explicit axes a jitted function's arguments
    # and the sharded arrays it closes over (the batch) must share one mesh.
    params = jax.device_put(params, NamedSharding(mesh, P()))

    def loss(p):
      logits = nnx.merge(graphdef, p)(batch["input_ids"], segment_ids=batch["segment_ids"],
                                      segment_positions=batch["segment_positions"])
      return loss_lib.cross_entropy_loss(logits, batch["labels"])[0], logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads

  want_logits, want_grads = logits_and_grads(attention_implementation="xla")
  logits, grads = logits_and_grads(attention_implementation="pallas",
                                   attention_pallas=PallasOptions(interpret=True),
                                   attention_mesh=mesh)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


def test_the_backend_is_resolved_once_at_construction():
  """None becomes the platform's backend in `DecoderConfig` (and in the trainer's check), so the
  layers are handed a concrete name and never decide again."""
  from configs import packed  # pylint: disable=g-import-not-at-top
  from train import config_checks as train_lib  # pylint: disable=g-import-not-at-top
  cfg = model_config.DecoderConfig(vocab_size=16, attention_implementation=None)
  assert cfg.attention_implementation == ("xla" if jax.default_backend() == "cpu" else "pallas")
  config = packed.get_config("smoke")
  config.attention.implementation = None
  assert train_lib.check_attention(config.attention, platform="cpu") == "xla"
  assert train_lib.check_attention(config.attention, platform="gpu") == "pallas"

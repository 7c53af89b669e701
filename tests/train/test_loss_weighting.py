"""Proofs of `loss.weighting`: packed token- and sequence-weighted losses equal unpacked training.

The oracle is the same documents run one per row (padded) through the same model, with the loss
written as a plain per-document loop in NumPy (float64) and the gradients combined per document:
  token:    sum over documents of NLL_d / sum over documents of n_d
  sequence: mean over documents with n_d > 0 of NLL_d / n_d
(n_d = trained tokens of document d). Never the code under test.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from support.packing_oracles import naive_rows
from segpack import loss as loss_lib
from train import checkpoint_compat as ckpt_compat
from train.model import config as model_config
from train.model import decoder as model_lib
from train import steps as steps_lib
from train.objective import TokenObjective

VOCAB = 37
LENGTHS = [9, 4, 15, 6, 1, 11, 3, 20, 2]  # unequal; the 1-token document has no trained token
ROWS = [[0, 1, 2], [3, 4, 5], [6, 7], [8]]  # documents per packed row
SEQ_LEN = 28


@functools.lru_cache(maxsize=None)
def _model():
  cfg = model_config.DecoderConfig(vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4,
                                num_kv_heads=2, head_dim=8, d_ff=48, init_std=0.2,
                                attention_implementation="xla", dtype="float32")
  return nnx.split(model_lib.Decoder(cfg, rngs=nnx.Rngs(params=0)))


def _docs(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, VOCAB, size=n).astype(np.int32) for n in LENGTHS]


def _pack(docs_per_row, seq_len):
  return {k: jnp.asarray(v) for k, v in naive_rows(docs_per_row, seq_len).items()}


def _logits(graphdef, params, batch):
  return nnx.merge(graphdef, params)(batch["input_ids"], segment_ids=batch["segment_ids"],
                                      segment_positions=batch["segment_positions"])


def _combine(weighting, counts, values):
  """The weighting's combination of per-document NLL sums (scalars or gradient arrays)."""
  if weighting == "token":
    return sum(values) / sum(counts)
  kept = [(v, n) for v, n in zip(values, counts) if n > 0]
  return sum(v / n for v, n in kept) / len(kept)


@functools.lru_cache(maxsize=None)
def _per_document():
  """The documents trained unpacked, one per row (padded): per document its trained tokens, its
  NLL sum (a NumPy float64 loop over the logits) and the gradient of that sum."""
  graphdef, params = _model()
  docs = _docs()
  unpacked = _pack([[d] for d in docs], max(len(d) for d in docs))
  logits = np.asarray(jax.jit(_logits, static_argnums=0)(graphdef, params, unpacked), np.float64)
  counts, nll = [], []
  for i, doc in enumerate(docs):
    total = 0.0
    for s in range(len(doc) - 1):
      row = logits[i, s]
      top = row.max()
      total += top + math.log(sum(math.exp(x - top) for x in row)) - row[doc[s + 1]]
    counts.append(len(doc) - 1)
    nll.append(total)

  def per_doc_nll(p):
    logp = jax.nn.log_softmax(_logits(graphdef, p, unpacked), axis=-1)
    return jnp.stack([-jnp.sum(logp[i, jnp.arange(len(d) - 1), d[1:]]) for i, d in enumerate(docs)])

  jac = jax.jit(jax.jacrev(per_doc_nll))(params)
  grads = [jax.tree.map(lambda j, i=i: np.asarray(j[i], np.float64), jac)
           for i in range(len(docs))]
  return counts, nll, grads


def _oracle(weighting):
  """Loss and gradients of the documents trained unpacked under `weighting`."""
  counts, nll, grads = _per_document()
  return (_combine(weighting, counts, nll),
          jax.tree.map(lambda *g: _combine(weighting, counts, g), *grads))


def _packed_loss(params, graphdef, batch, weighting):
  return loss_lib.cross_entropy_loss(_logits(graphdef, params, batch), batch["labels"],
                                     weighting=weighting,
                                     segment_ids_BxS=batch["segment_ids"])[0]


_packed_loss_jit = jax.jit(_packed_loss, static_argnums=(1, 3))
_packed_value_and_grad_jit = jax.jit(jax.value_and_grad(_packed_loss), static_argnums=(1, 3))


def _packed_value_and_grad(graphdef, params, batch, weighting):
  return _packed_value_and_grad_jit(params, graphdef, batch, weighting)


@pytest.mark.parametrize("weighting", ["token", "sequence"])
def test_packed_loss_and_grads_equal_unpacked_per_document_oracle(weighting):
  graphdef, params = _model()
  docs = _docs()
  batch = _pack([[docs[i] for i in row] for row in ROWS], SEQ_LEN)
  loss, grads = _packed_value_and_grad(graphdef, params, batch, weighting)
  want_loss, want_grads = _oracle(weighting)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)


def test_the_two_weightings_differ_on_unequal_lengths():
  graphdef, params = _model()
  docs = _docs()
  batch = _pack([[docs[i] for i in row] for row in ROWS], SEQ_LEN)
  token, g_token = _packed_value_and_grad(graphdef, params, batch, "token")
  sequence, g_sequence = _packed_value_and_grad(graphdef, params, batch, "sequence")
  assert abs(float(token) - float(sequence)) > 1e-2, (float(token), float(sequence))
  worst = max(float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves(g_token), jax.tree.leaves(g_sequence)))
  assert worst > 1e-3


def _step(graphdef, params, batch, *, accum, weighting):
  """One plain-SGD (lr 1) train step: new params = params - gradient of the step's loss."""
  tx, schedule = optax.sgd(1.0), optax.constant_schedule(1.0)
  state = dict(params=params, opt_state=tx.init(params), step=jnp.int32(0))
  step = steps_lib.make_train_step(graphdef, tx, schedule, accum=accum,
                                   objective=TokenObjective(weighting=weighting))
  return jax.jit(step)(state, batch)


def test_accumulation_over_two_micro_batches_is_exact_in_sequence_mode():
  graphdef, params = _model()
  docs = _docs()
  batch = _pack([[docs[i] for i in row] for row in ROWS], SEQ_LEN)
  # Micro-batches are rows (0, 2) and (1, 3): 5 and 3 documents with trained tokens, so a
  # per-micro-batch normaliser would weigh the documents unequally.
  one, m_one = _step(graphdef, params, batch, accum=1, weighting="sequence")
  two, m_two = _step(graphdef, params, batch, accum=2, weighting="sequence")
  want_loss, want_grads = _oracle("sequence")
  assert float(m_one["loss_count"]) == float(m_two["loss_count"]) == 8.0
  np.testing.assert_allclose(float(m_two["loss"]), want_loss, rtol=1e-6)
  np.testing.assert_allclose(float(m_one["loss"]), want_loss, rtol=1e-6)
  for a, b, p, g in zip(jax.tree.leaves(two["params"]), jax.tree.leaves(one["params"]),
                        jax.tree.leaves(params), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(p) - np.asarray(a), g, rtol=0, atol=1e-6)
  # The batch can tell: the mean of the two micro-batches' own sequence losses is another number.
  halves = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]
  local = np.mean([float(_packed_loss_jit(params, graphdef, h, "sequence")) for h in halves])
  assert abs(local - want_loss) > 1e-3


def test_eval_step_gives_the_mean_of_per_document_means_over_batches():
  graphdef, params = _model()
  docs = _docs()
  batches = [_pack([[docs[i] for i in row] for row in ROWS[:2]], SEQ_LEN),
             _pack([[docs[i] for i in row] for row in ROWS[2:]], SEQ_LEN)]
  step = jax.jit(steps_lib.make_eval_step(graphdef,
                                          objective=TokenObjective(weighting="sequence")))
  loss_sum, count, tokens = 0.0, 0.0, 0.0
  for b in batches:
    out = step(params, b)
    s, c, k = out["loss_sum"], out["count"], out["trained_tokens"]
    loss_sum, count, tokens = loss_sum + float(s), count + float(c), tokens + float(k)
  want, _ = _oracle("sequence")
  np.testing.assert_allclose(loss_sum / count, want, rtol=1e-6)
  assert count == 8 and tokens == sum(n - 1 for n in LENGTHS)


def _naive_sequence_loss(logits, labels, segments):
  """Per-document loop: mean over segments with trained tokens of their mean token loss."""
  per_doc = {}
  for b in range(labels.shape[0]):
    for s in range(labels.shape[1]):
      if labels[b, s] == -100 or segments[b, s] == 0:
        continue
      row = logits[b, s].astype(np.float64)
      nll = math.log(sum(math.exp(x) for x in row)) - row[labels[b, s]]
      per_doc.setdefault((b, int(segments[b, s])), []).append(nll)
  return float(np.mean([np.mean(v) for v in per_doc.values()])), len(per_doc)


def test_document_without_trained_tokens_is_excluded():
  rng = np.random.default_rng(1)
  segments = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0],
                       [1, 1, 1, 1, 1, 1, 2, 2, 2, 2]], np.int32)
  labels = rng.integers(0, 7, size=segments.shape).astype(np.int32)
  labels[segments == 0] = -100
  labels[0, 3:7] = -100  # segment 2 of row 0: four tokens, none trained (a masked user turn)
  labels[1, 5] = -100
  logits = (rng.normal(size=segments.shape + (7,)) * 2).astype(np.float32)
  want, docs = _naive_sequence_loss(logits, labels, segments)
  assert docs == 4
  loss, count = loss_lib.cross_entropy_loss(jnp.asarray(logits), jnp.asarray(labels),
                                            weighting="sequence",
                                            segment_ids_BxS=jnp.asarray(segments))
  assert float(count) == 4.0
  assert float(loss_lib.count_trained_documents(
      jnp.asarray(labels), segment_ids_BxS=jnp.asarray(segments))) == 4.0
  np.testing.assert_allclose(float(loss), want, rtol=1e-6)
  assert abs(want * 4 / 5 - want) > 1e-3  # counting the empty document would change the loss
  counts = np.asarray(loss_lib.document_token_counts(jnp.asarray(labels),
                                                     segment_ids_BxS=jnp.asarray(segments)))
  assert counts.shape == (2, 11)
  np.testing.assert_array_equal(counts[:, :4], [[0, 3, 0, 2], [0, 5, 4, 0]])


def test_sequence_loss_accumulates_exactly_over_slices():
  rng = np.random.default_rng(2)
  segments = np.sort(rng.integers(0, 4, size=(6, 12)), axis=1).astype(np.int32)
  labels = np.where(segments > 0, rng.integers(0, 5, size=(6, 12)), -100).astype(np.int32)
  labels[2] = -100
  logits = jnp.asarray(rng.normal(size=(6, 12, 5)).astype(np.float32))
  labels, segments = jnp.asarray(labels), jnp.asarray(segments)

  def full(lo):
    return loss_lib.cross_entropy_loss(lo, labels, weighting="sequence",
                                       segment_ids_BxS=segments)[0]

  def accumulated(lo):
    total = loss_lib.loss_normalizer(labels, weighting="sequence", segment_ids_BxS=segments)
    return sum(loss_lib.cross_entropy_loss(lo[i:i + 2], labels[i:i + 2], normalizer=total,
                                           weighting="sequence",
                                           segment_ids_BxS=segments[i:i + 2])[0]
               for i in range(0, 6, 2))

  np.testing.assert_allclose(float(jax.jit(full)(logits)),
                             _naive_sequence_loss(np.asarray(logits), np.asarray(labels),
                                                  np.asarray(segments))[0], rtol=1e-6)
  np.testing.assert_allclose(float(jax.jit(accumulated)(logits)), float(jax.jit(full)(logits)),
                             rtol=1e-6)
  np.testing.assert_allclose(jax.jit(jax.grad(accumulated))(logits),
                             jax.jit(jax.grad(full))(logits), atol=1e-7)


def test_sequence_loss_memory_is_linear_in_the_row_length():
  b, s, v = 2, 512, 8

  def fn(lo, la, sg):
    return loss_lib.cross_entropy_loss(lo, la, weighting="sequence", segment_ids_BxS=sg)[0]

  args = (jnp.zeros((b, s, v)), jnp.zeros((b, s), jnp.int32), jnp.ones((b, s), jnp.int32))
  jaxpr = jax.make_jaxpr(jax.grad(fn))(*args)
  biggest = max(int(np.prod(var.aval.shape)) for eqn in jaxpr.jaxpr.eqns for var in eqn.outvars
                if hasattr(var.aval, "shape"))
  assert biggest <= b * s * v  # the logits; a [B, S, S] intermediate would be 524,288


def test_bad_weighting_and_missing_segments_are_refused():
  logits, labels = jnp.zeros((1, 4, 3)), jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="weighting.*'document'"):
    loss_lib.cross_entropy_loss(logits, labels, weighting="document")
  with pytest.raises(ValueError, match="segment_ids_BxS"):
    loss_lib.cross_entropy_loss(logits, labels, weighting="sequence")
  with pytest.raises(ValueError, match=r"loss.weighting.*'mean'"):
    TokenObjective(weighting="mean")


def test_weighting_is_not_a_resumable_change():
  saved = dict(train=dict(seed=0), loss=dict(weighting="token"))
  assert ckpt_compat.config_differences(saved, saved) == []
  diffs = ckpt_compat.config_differences(saved, dict(train=dict(seed=0),
                                                  loss=dict(weighting="sequence")))
  assert diffs == ["loss.weighting: checkpoint has 'token', config has 'sequence'"]
  assert "loss.weighting" not in ckpt_compat.RESUMABLE_CHANGES
  absent = ckpt_compat.config_differences(dict(train=dict(seed=0)), saved)  # no silent default
  assert absent == ["loss.weighting: checkpoint has '<absent>', config has 'token'"]


def test_sequence_loss_sharded_over_devices_equals_the_naive_loop():
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  b = 2 * jax.device_count()
  segments = np.sort(rng.integers(0, 5, size=(b, 16)), axis=1).astype(np.int32)
  labels = np.where(segments > 0, rng.integers(0, 5, size=(b, 16)), -100).astype(np.int32)
  logits = rng.normal(size=(b, 16, 5)).astype(np.float32)
  rows = NamedSharding(jax.make_mesh((jax.device_count(),), ("data",)), P("data"))
  fn = jax.jit(lambda lo, la, sg: loss_lib.cross_entropy_loss(
      lo, la, weighting="sequence", segment_ids_BxS=sg)[0])
  got = fn(*(jax.device_put(x, rows) for x in (logits, labels, segments)))
  np.testing.assert_allclose(float(got), _naive_sequence_loss(logits, labels, segments)[0],
                             rtol=1e-6)

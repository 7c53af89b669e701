"""`segpack.loss.blocks`: the blocked cross-entropy equals the full-logits one, and never holds
the full logits.

The reference is `segpack.loss` on the full logits `hidden @ W` (itself checked against a plain
loop in tests/loss/test_tokens.py) and, for the token losses, a float64 NumPy loop written here.
The blocked token losses are weighted as the full ones are (`token_loss_sum`,
`token_loss_by_source`).
Rows are packed (several segments, `-100` at every segment's last slot and on padding, one row
wholly ignored); block sizes divide the row count of positions or do not; vocabulary chunks
divide V or do not. Negative controls: a blocked loss that drops the last partial block, and
per-document sums whose segments are shifted one slot across a boundary, fail the same
comparison. The memory checks compile the loss and its gradients for Qwen's 151,643-token
vocabulary and read XLA's temporary bytes, and walk the traced program for any `[B*S, V]`-sized
array.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from segpack import loss as loss_lib
from segpack.loss import blocks
from segpack.errors import ArgumentError

B, S, E, V = 3, 37, 16, 101  # B*S = 111 positions
RTOL = 1e-6  # float32: what the blocked loss must keep against the full one
QWEN_VOCAB = 151_643


@functools.lru_cache(maxsize=None)
def _inputs(seed=0):
  """Hidden states, an `[E, V]` projection, packed labels, segment ids and sources."""
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(B, S, E)).astype(np.float32)
  weight = (rng.normal(size=(E, V)) * 0.3).astype(np.float32)
  seg = np.zeros((B, S), np.int32)
  for row, lengths in enumerate(([10, 7, 15], [S], [5, 5, 5, 5, 4])):
    ends = np.cumsum(lengths)
    for n, (start, end) in enumerate(zip(ends - lengths, ends)):
      seg[row, start:end] = n + 1
  labels = rng.integers(0, V, size=(B, S)).astype(np.int32)
  last = np.append(seg[:, 1:] != seg[:, :-1], np.ones((B, 1), bool), axis=1)
  labels[last | (seg == 0)] = -100  # each segment's last slot and the padding
  labels[1] = -100  # a row with no trained token: all-ignored blocks
  sources = np.where(seg > 0, seg % 2, -1).astype(np.int32)
  return hidden, weight, labels, seg, sources


def _projection(weight, tied):
  """The keyword of the head: `weight` is the tied head's `[V, E]` table when `tied`."""
  return dict(embedding_VxE=weight) if tied else dict(weight_ExV=weight)


def _rel(got, want):
  """The largest difference over the largest magnitude of `want`."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _close(got, want):
  return all(_rel(g, w) <= RTOL for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _numpy_token_losses(hidden, weight, labels):
  logits = hidden.astype(np.float64) @ weight.astype(np.float64)
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  picked = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
  return np.where(labels != -100, lse - picked, 0.0)


def _mean(loss_sum, count):
  """`cross_entropy_loss`'s division of a summed loss by its own count."""
  return loss_sum / jnp.maximum(count, 1.0)


def _full(hidden, weight, labels, seg, sources, tied):
  """(token-weighted loss, sequence-weighted loss, per-source sums) from the full logits."""
  table = weight.T  # the tied head's [V, E] embedding, as the model multiplies it
  logits = jnp.dot(hidden, table.T) if tied else jnp.dot(hidden, weight)
  token = loss_lib.cross_entropy_loss(logits, labels)[0]
  sequence = loss_lib.cross_entropy_loss(logits, labels, weighting="sequence",
                                         segment_ids_BxS=seg)[0]
  by_source = loss_lib.token_loss_by_source(loss_lib.token_cross_entropy(logits, labels), labels,
                                           sources, num_sources=2)[0]
  return token, sequence, by_source


def _blocked(hidden, weight, labels, seg, sources, tied, block, chunk):
  kw = dict(block_size=block, vocab_block_size=chunk,
            **_projection(weight.T if tied else weight, tied))
  token_loss = blocks.blocked_token_losses(hidden, labels, **kw)
  token = _mean(*loss_lib.token_loss_sum(token_loss, labels))
  sequence = _mean(*loss_lib.token_loss_sum(token_loss, labels, weighting="sequence",
                                            segment_ids_BxS=seg))
  by_source = loss_lib.token_loss_by_source(token_loss, labels, sources, num_sources=2)[0]
  return token, sequence, by_source


def _values_and_grads(fn, hidden, weight):
  """`fn`'s results (token loss, sequence loss, the two per-source sums) as one vector, and the
  gradient of each w.r.t. the hidden states and the projection, in one compiled program."""
  def vector(h, w):
    token, sequence, by_source = fn(h, w)
    return jnp.concatenate([token[None], sequence[None], by_source])
  return jax.jit(lambda h, w: (vector(h, w), jax.jacrev(vector, (0, 1))(h, w)))(hidden, weight)


@functools.lru_cache(maxsize=None)
def _want(tied):
  hidden, weight, labels, seg, sources = (jnp.asarray(x) for x in _inputs())
  return _values_and_grads(functools.partial(_full, labels=labels, seg=seg, sources=sources,
                                             tied=tied), hidden, weight)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("block,chunk", [(37, None), (16, 25)])
def test_blocked_equals_full_losses_and_gradients(tied, block, chunk):
  """37 divides B*S (a block per row: row 1's block is all ignored), 16 does not; V=101 whole,
  or in chunks of 25 (5 chunks, the last overlapping its neighbour).
  Each of the four results (token loss, sequence loss, two per-source sums) and its gradients
  w.r.t. the hidden states and the projection."""
  hidden, weight, labels, seg, sources = (jnp.asarray(x) for x in _inputs())
  blocked = functools.partial(_blocked, labels=labels, seg=seg, sources=sources, tied=tied,
                              block=block, chunk=chunk)
  got, (got_h, got_w) = _values_and_grads(blocked, hidden, weight)
  want, (want_h, want_w) = _want(tied)
  names = ("token", "sequence", "source 0", "source 1")
  for i, name in enumerate(names):
    assert _rel(got[i], want[i]) <= RTOL, (name, _rel(got[i], want[i]))  # measured: 2e-7
    assert _rel(got_h[i], want_h[i]) <= RTOL, (name, _rel(got_h[i], want_h[i]))  # 5e-7
    assert _rel(got_w[i], want_w[i]) <= RTOL, (name, _rel(got_w[i], want_w[i]))  # 3e-7


def test_token_losses_equal_a_float64_loop_and_are_zero_where_ignored():
  hidden, weight, labels, _, _ = _inputs()
  for block, chunk in ((16, None), (5, 9)):
    got = np.asarray(blocks.blocked_token_losses(
        jnp.asarray(hidden), jnp.asarray(labels), block_size=block, vocab_block_size=chunk,
        weight_ExV=jnp.asarray(weight)))
    want = _numpy_token_losses(hidden, weight, labels)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    assert got.dtype == np.float32 and np.all(got[labels == -100] == 0)


def test_negative_controls_fail_the_comparison():
  """What a blocked loss gets wrong is seen by the same comparison: the last partial block
  dropped (111 = 6 * 16 + 15 positions), or segments shifted one slot, so a document's sum
  takes its neighbour's first token."""
  hidden, weight, labels, seg, sources = (jnp.asarray(x) for x in _inputs())
  want = jax.jit(_full, static_argnums=5)(hidden, weight, labels, seg, sources, False)
  blocked = jax.jit(_blocked, static_argnums=(5, 6, 7))
  right = blocked(hidden, weight, labels, seg, sources, False, 16, None)
  kept = (B * S) // 16 * 16
  flat_labels = labels.reshape(-1).at[kept:].set(-100).reshape(B, S)  # the partial block dropped
  dropped = blocked(hidden, weight, flat_labels, seg, sources, False, 16, None)
  shifted = blocked(hidden, weight, labels, jnp.roll(seg, 1, axis=1), sources, False, 16, None)
  assert _close(right, want)
  assert not _close(dropped, want) and _rel(dropped[0], want[0]) > 1e-3
  assert not _close(shifted[1], want[1]) and _rel(shifted[1], want[1]) > 1e-3


@pytest.mark.parametrize("tied,chunk", [(False, 7), (True, None)], ids=["untied", "tied"])
def test_vocabulary_split_over_a_mesh_axis_equals_one_device(tied, chunk):
  """Under `shard_map` on data=2 x tensor=4 with V=128 split over `tensor` (32 per device, in
  chunks of 7, or whole): the token losses and the gradients of the hidden states (summed over
  the devices' vocabulary shares) and of each device's share of the projection."""
  rng = np.random.default_rng(1)
  hidden = jnp.asarray(rng.normal(size=(4, 24, 16)), jnp.float32)
  weight = jnp.asarray(rng.normal(size=(16, 128)) * 0.3, jnp.float32)
  labels = rng.integers(0, 128, size=(4, 24)).astype(np.int32)
  labels[rng.random((4, 24)) < 0.3] = -100
  labels = jnp.asarray(labels)
  mesh = jax.make_mesh((2, 4), ("data", "tensor"))
  w_spec = P("tensor", None) if tied else P(None, "tensor")  # the tied head's table is [V, E]

  def full(h, w):
    return jnp.sum(loss_lib.token_cross_entropy(jnp.dot(h, w), labels) ** 2)

  def split(h, w, chunk):
    def per_device(h_, w_, l_):
      return blocks.blocked_token_losses(h_, l_, block_size=5, vocab_block_size=chunk,
                                         vocab_axis="tensor", **_projection(w_, tied))
    specs = (P("data", None, None), w_spec, P("data", None))
    args = [jax.sharding.reshard(x, NamedSharding(mesh, spec))
            for x, spec in zip((h, w.T if tied else w, labels), specs)]
    token_loss = jax.shard_map(per_device, mesh=mesh, in_specs=specs,
                               out_specs=P("data", None))(*args)
    return jnp.sum(token_loss ** 2)

  want, want_grads = jax.jit(jax.value_and_grad(full, (0, 1)))(hidden, weight)
  with jax.set_mesh(mesh):
    got, got_grads = jax.jit(jax.value_and_grad(functools.partial(split, chunk=chunk),
                                                (0, 1)))(hidden, weight)
  assert _rel(got, want) <= RTOL
  assert _rel(got_grads[0], want_grads[0]) <= RTOL  # measured: 3.4e-7
  assert _rel(got_grads[1], want_grads[1]) <= RTOL  # measured: 4.1e-7


def _temp_bytes(vocab, *, block, chunk=None, seq=2048, e=64):
  """XLA's temporary bytes of the loss and its gradients (hidden and projection), compiled for
  one row of `seq` positions: the full logits (`block` 0) or blocked."""
  hidden = jax.ShapeDtypeStruct((1, seq, e), jnp.float32)
  weight = jax.ShapeDtypeStruct((e, vocab), jnp.float32)
  labels = jax.ShapeDtypeStruct((1, seq), jnp.int32)

  def loss(h, w, lab):
    if block == 0:
      return loss_lib.cross_entropy_loss(jnp.dot(h, w), lab)[0]
    token_loss = blocks.blocked_token_losses(h, lab, block_size=block, vocab_block_size=chunk,
                                             weight_ExV=w)
    return _mean(*loss_lib.token_loss_sum(token_loss, lab))

  step = jax.jit(jax.value_and_grad(loss, (0, 1)))
  return step.lower(hidden, weight, labels).compile().memory_analysis().temp_size_in_bytes, step


def _largest_array(jaxpr):
  """The most elements of any value in `jaxpr` and the programs inside it."""
  most = 0
  for eqn in jaxpr.eqns:
    for var in list(eqn.invars) + list(eqn.outvars):
      most = max(most, int(np.prod(getattr(var.aval, "shape", ()))))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      most = max(most, _largest_array(sub))
  return most


def test_the_blocked_loss_never_builds_the_full_logits():
  """V = 151,643, E = 64, S = 2048 (one row): the full loss and its gradients need about
  2 * S * V * 4 bytes (2.5 GB); blocked by 256 positions about 1.25 * 256 * V * 4, and with
  chunks of 8192 columns a few [256, 8192] arrays whatever V is: doubling V adds less than
  the projection's own size. No value of the traced program has S * V elements."""
  n, logits_bytes = 2048, 2048 * QWEN_VOCAB * 4
  full, _ = _temp_bytes(QWEN_VOCAB, block=0)
  rows, _ = _temp_bytes(QWEN_VOCAB, block=256)
  chunked, step = _temp_bytes(QWEN_VOCAB, block=256, chunk=8192)
  chunked_2v, _ = _temp_bytes(2 * QWEN_VOCAB, block=256, chunk=8192)
  full_2v, _ = _temp_bytes(2 * QWEN_VOCAB, block=0)
  assert full >= logits_bytes and full_2v >= 1.9 * full  # the baseline holds [S, V], twice
  assert rows < logits_bytes / 5  # measured: 194 MB against 1.24 GB of logits
  assert chunked < logits_bytes / 50  # measured: 16.9 MB
  assert chunked_2v - chunked < 64 * QWEN_VOCAB * 4  # measured: +64 bytes
  args = (jax.ShapeDtypeStruct((1, n, 64), jnp.float32),
          jax.ShapeDtypeStruct((64, QWEN_VOCAB), jnp.float32),
          jax.ShapeDtypeStruct((1, n), jnp.int32))
  largest = _largest_array(jax.make_jaxpr(step)(*args).jaxpr)
  assert 64 * QWEN_VOCAB <= largest < n * QWEN_VOCAB // 8  # the projection is the largest


def test_bad_arguments_are_named():
  hidden, weight, labels, _, _ = (jnp.asarray(x) for x in _inputs())
  with pytest.raises(ArgumentError, match="exactly one of weight_ExV"):
    blocks.blocked_token_losses(hidden, labels, block_size=4)
  with pytest.raises(ArgumentError, match="both"):
    blocks.blocked_token_losses(hidden, labels, block_size=4, weight_ExV=weight,
                                embedding_VxE=weight.T)
  with pytest.raises(ArgumentError, match="block_size must be a positive int, got 0"):
    blocks.blocked_token_losses(hidden, labels, block_size=0, weight_ExV=weight)
  with pytest.raises(ArgumentError, match="vocab_block_size must be a positive int, got -1"):
    blocks.blocked_token_losses(hidden, labels, block_size=4, vocab_block_size=-1,
                                weight_ExV=weight)
  with pytest.raises(ArgumentError, match=r"embedding_VxE shape \(16, 101\)"):
    blocks.blocked_token_losses(hidden, labels, block_size=4, embedding_VxE=weight)
  with pytest.raises(ArgumentError, match="must be labels shape"):
    blocks.blocked_token_losses(hidden, labels[:, :5], block_size=4, weight_ExV=weight)

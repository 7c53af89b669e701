"""Cross-entropy from the final hidden states, a block of positions at a time (no full logits).

A language model's loss needs, per trained token, `logsumexp(logits) - logits[label]`, where
`logits = hidden @ W` has one row of V scores per position. Written plainly, a batch of `N = B*S`
positions holds `[N, V]` float32 logits and as many for their gradient: 5 GB at V = 151,643 and
N = 4,096. Here the positions are cut into blocks of `block_size` (the last one padded with
ignored positions) and a `jax.lax.scan` computes one block's logits at a time, and of those,
with `vocab_block_size`, one chunk of columns at a time (an online logsumexp: the running
maximum and the sum of exponentials below it). The whole computation is one `jax.custom_vjp`
whose forward pass keeps only each position's logsumexp (`[N]` float32); its backward pass
walks the blocks and chunks again, recomputes each chunk's logits, forms their gradient
`g * (softmax - onehot)` from the saved logsumexp, and adds its products into the gradients of
the hidden states and of the projection (float32 sums). The largest temporary is then a few
`[block, chunk]` arrays, forward and backward, whatever N and V are; the cost is one more
`[block, E] x [E, V]` matmul per block (the recomputation).

The result is every token's loss, float32 `[B, S]` (0 where the label is ignored), the very
numbers `segpack.loss.token_cross_entropy` computes from the full logits, so the weightings
and per-source sums are the plain loss's own: `segpack.loss.token_loss_sum` and
`token_loss_by_source` read them as they are.

The projection is `weight_ExV` (an untied output layer, `logits = hidden @ W`) or
`embedding_VxE` (tied to the input embedding, `logits = hidden @ table.T`); the matmul runs in
the dtype of the arrays given (promote them first, as the model does) and its result is cast
to float32, as the model's head casts its logits.

Vocabulary split over devices (`vocab_axis`, inside `jax.shard_map` with the projection's V
split over that mesh axis, Megatron style): each device computes its `[block, V / n]` logits,
the block's maximum (`pmax`), sum of exponentials and label logit (`psum`) are combined over the
axis, and the gradients flow back through the collectives; without it V must be whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from segpack.errors import ArgumentError
from segpack.loss.labels import IGNORE_INDEX


def _projection(weight_ExV: jax.Array | None, embedding_VxE: jax.Array | None,
                hidden_BxSxE: jax.Array, fn: str) -> tuple[jax.Array, bool]:
  """`(the projection, tied)`, checked: exactly one given, its E the hidden states' E."""
  if (weight_ExV is None) == (embedding_VxE is None):
    raise ArgumentError(f"{fn}: give exactly one of weight_ExV (untied head) and embedding_VxE "
                        f"(tied head), got {'both' if weight_ExV is not None else 'neither'}")
  tied = weight_ExV is None
  weight = embedding_VxE if tied else weight_ExV
  e_axis = 1 if tied else 0
  if weight.ndim != 2 or weight.shape[e_axis] != hidden_BxSxE.shape[-1]:
    name = "embedding_VxE" if tied else "weight_ExV"
    raise ArgumentError(f"{fn}: {name} shape {tuple(weight.shape)} does not match the hidden "
                        f"states' E of shape {tuple(hidden_BxSxE.shape)}")
  return weight, tied


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static shape of one blocked loss: the projection's layout and how V is chunked."""

  tied: bool  # the projection is `[V, E]` (tied) rather than `[E, V]`
  vocab: int  # V of the projection given (this device's share inside `shard_map`)
  chunk: int  # vocabulary columns per chunk
  chunks: int  # chunks per block of positions
  ignore_index: int
  vocab_axis: str | None

  def columns(self, weight: jax.Array, j: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(the projection's columns of chunk j, its first column)`: chunk j covers `[start, start +
    chunk)` with `start = min(j * chunk, V - chunk)`, so the last chunk overlaps its neighbour
    instead of running past V; the overlap's columns are counted by the earlier chunk only."""
    if self.chunks == 1:
      return weight, jnp.int32(0)
    start = jnp.minimum(j * self.chunk, self.vocab - self.chunk).astype(jnp.int32)
    axis = 0 if self.tied else 1
    return jax.lax.dynamic_slice_in_dim(weight, start, self.chunk, axis=axis), start

  def logits(self, w_chunk: jax.Array, h_KxE: jax.Array, start: jax.Array,
             j: jax.Array) -> jax.Array:
    """A chunk's float32 logits `[K, C]`, -inf on the columns an earlier chunk counted."""
    logits_KxC = jnp.dot(h_KxE, w_chunk.T) if self.tied else jnp.dot(h_KxE, w_chunk)
    logits_KxC = logits_KxC.astype(jnp.float32)
    if self.chunks == 1:
      return logits_KxC
    fresh_C = start + jnp.arange(self.chunk) >= j * self.chunk
    return jnp.where(fresh_C, logits_KxC, -jnp.inf)

  def label_column(self, labels_K: jax.Array, start: jax.Array, j: jax.Array) -> jax.Array:
    """Each label's column in chunk j, -1 where the chunk does not count it (elsewhere, ignored,
    or on another device's share of V)."""
    local_K = labels_K
    if self.vocab_axis is not None:
      local_K = labels_K - jax.lax.axis_index(self.vocab_axis) * self.vocab
    column_K = local_K - start
    counted_K = ((labels_K != self.ignore_index) & (column_K >= 0) & (column_K < self.chunk)
                 & (local_K >= j * self.chunk))
    return jnp.where(counted_K, column_K, -1)


def _vma(x: jax.Array) -> frozenset:
  """The mesh axes `x` varies over inside `jax.shard_map` (empty elsewhere): its type's
  `manual_axis_type.varying` (`vma` before JAX 0.10)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _varying(x: jax.Array, *like: jax.Array) -> jax.Array:
  """`x` typed as varying over every axis the arrays `like` vary over (a scan's carry must keep
  its type)."""
  axes = frozenset().union(*map(_vma, like)) - _vma(x)
  return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def _summed_to(x: jax.Array, like: jax.Array) -> jax.Array:
  """`x` summed over the axes it varies over and `like` does not: a cotangent of `like` (the
  contributions of the devices that share it)."""
  axes = _vma(x) - _vma(like)
  return jax.lax.psum(x, tuple(sorted(axes))) if axes else x


def _block_forward(plan: _Plan, weight: jax.Array, h_KxE: jax.Array,
                   labels_K: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(token losses, logsumexp)`, `[K]` each, of one block, its vocabulary a chunk at a time
  (online logsumexp: the running maximum and the sum of exponentials below it)."""
  k = labels_K.shape[0]

  def chunk(carry, j):
    top_K, sum_exp_K, target_K = carry
    w_chunk, start = plan.columns(weight, j)
    logits_KxC = plan.logits(w_chunk, h_KxE, start, j)
    new_top_K = jnp.maximum(top_K, jnp.max(logits_KxC, axis=-1))
    sum_exp_K = (sum_exp_K * jnp.exp(top_K - new_top_K)
                 + jnp.sum(jnp.exp(logits_KxC - new_top_K[:, None]), axis=-1))
    column_K = plan.label_column(labels_K, start, j)
    picked_K = jnp.take_along_axis(logits_KxC, jnp.maximum(column_K, 0)[:, None], axis=-1)[:, 0]
    return (new_top_K, sum_exp_K, target_K + jnp.where(column_K >= 0, picked_K, 0.0)), None

  zeros_K = _varying(jnp.zeros((k,), jnp.float32), weight, h_KxE)
  init = (zeros_K - jnp.inf, zeros_K, zeros_K)
  if plan.chunks == 1:
    (top_K, sum_exp_K, target_K), _ = chunk(init, jnp.int32(0))
  else:
    (top_K, sum_exp_K, target_K), _ = jax.lax.scan(chunk, init, jnp.arange(plan.chunks))
  if plan.vocab_axis is not None:
    all_top_K = jax.lax.pmax(top_K, plan.vocab_axis)
    sum_exp_K = jax.lax.psum(sum_exp_K * jnp.exp(top_K - all_top_K), plan.vocab_axis)
    top_K, target_K = all_top_K, jax.lax.psum(target_K, plan.vocab_axis)
  lse_K = top_K + jnp.log(sum_exp_K)
  return jnp.where(labels_K != plan.ignore_index, lse_K - target_K, 0.0), lse_K


def _block_backward(plan: _Plan, weight: jax.Array, h_KxE: jax.Array, labels_K: jax.Array,
                    lse_K: jax.Array, g_K: jax.Array, dw_f32: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
  """One block's `(projection gradient added to dw_f32, hidden-state gradient [K, E] float32)`:
  the logits' gradient `g * (softmax - onehot)` is formed a chunk at a time from the saved
  logsumexp, and never whole."""
  g_K = jnp.where(labels_K != plan.ignore_index, g_K, 0.0)

  def chunk(carry, j):
    dw_f32, dh_KxE = carry
    w_chunk, start = plan.columns(weight, j)
    logits_KxC = plan.logits(w_chunk, h_KxE, start, j)
    column_K = plan.label_column(labels_K, start, j)
    onehot_KxC = column_K[:, None] == jnp.arange(logits_KxC.shape[-1])
    d_KxC = (g_K[:, None] * (jnp.exp(logits_KxC - lse_K[:, None]) - onehot_KxC)).astype(h_KxE.dtype)
    f32 = dict(preferred_element_type=jnp.float32)
    if plan.tied:  # w_chunk [C, E]
      dh_KxE += jnp.dot(d_KxC, w_chunk, **f32)
      dw_chunk = jnp.dot(d_KxC.T, h_KxE, **f32)
    else:  # w_chunk [E, C]
      dh_KxE += jnp.dot(d_KxC, w_chunk.T, **f32)
      dw_chunk = jnp.dot(h_KxE.T, d_KxC, **f32)
    if plan.chunks == 1:
      return (dw_f32 + dw_chunk, dh_KxE), None
    axis = 0 if plan.tied else 1
    old = jax.lax.dynamic_slice_in_dim(dw_f32, start, plan.chunk, axis=axis)
    return (jax.lax.dynamic_update_slice_in_dim(dw_f32, old + dw_chunk, start, axis=axis),
            dh_KxE), None

  dh_KxE = _varying(jnp.zeros(h_KxE.shape, jnp.float32), weight, h_KxE, g_K)
  if plan.chunks == 1:
    (dw_f32, dh_KxE), _ = chunk((dw_f32, dh_KxE), jnp.int32(0))
  else:
    (dw_f32, dh_KxE), _ = jax.lax.scan(chunk, (dw_f32, dh_KxE), jnp.arange(plan.chunks))
  return dw_f32, dh_KxE


def _blocked_losses(plan: _Plan) -> Any:
  """The token losses `[M, K]` of `(weight, h_MxKxE, labels_MxK)`, M blocks of K positions, as a
  `jax.custom_vjp`: the forward pass keeps each position's logsumexp (`[M, K]` float32) and
  the backward pass recomputes each block's logits from it, a chunk at a time."""

  def forward(weight, h_MxKxE, labels_MxK):
    def block(_, xs):
      return None, _block_forward(plan, weight, *xs)
    _, (loss_MxK, lse_MxK) = jax.lax.scan(block, None, (h_MxKxE, labels_MxK))
    return loss_MxK, (weight, h_MxKxE, labels_MxK, lse_MxK)

  def backward(residuals, g_MxK):
    weight, h_MxKxE, labels_MxK, lse_MxK = residuals

    def block(dw_f32, xs):
      return _block_backward(plan, weight, *xs, dw_f32)

    dw0 = _varying(jnp.zeros(weight.shape, jnp.float32), weight, h_MxKxE, g_MxK)
    dw_f32, dh_MxKxE = jax.lax.scan(block, dw0, (h_MxKxE, labels_MxK, lse_MxK, g_MxK))
    dh_MxKxE = _summed_to(dh_MxKxE, h_MxKxE).astype(h_MxKxE.dtype)
    return _summed_to(dw_f32, weight).astype(weight.dtype), dh_MxKxE, None

  losses = jax.custom_vjp(lambda weight, h, labels: forward(weight, h, labels)[0])
  losses.defvjp(forward, backward)
  return losses


def blocked_token_losses(
    hidden_BxSxE: jax.Array,
    labels_BxS: jax.Array,
    *,
    block_size: int,
    weight_ExV: jax.Array | None = None,
    embedding_VxE: jax.Array | None = None,
    vocab_block_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    vocab_axis: str | None = None,
) -> jax.Array:
  """Every token's cross-entropy, float32 `[B, S]` (0 where ignored), `block_size` positions at
  a time: what `segpack.loss.token_cross_entropy(hidden @ W, labels)` returns, without ever
  holding more than a block's logits, forward or backward (module docstring).

  Args:
    hidden_BxSxE: the final hidden states (after the last norm), `[..., E]`.
    labels_BxS: integer targets with the leading shape of `hidden_BxSxE`, in `[0, V)` or
      `ignore_index`.
    block_size: positions per block (> 0); the positions are flattened in row-major order and
      the last block is padded with ignored positions.
    weight_ExV: the untied output projection `[E, V]` (`logits = hidden @ weight_ExV`).
    embedding_VxE: or the tied one, the input embedding `[V, E]` (`logits = hidden @
      embedding_VxE.T`); exactly one of the two.
    vocab_block_size: vocabulary columns per chunk (an online logsumexp over the chunks); None
      (or V and more): the whole (local) vocabulary at once.
    ignore_index: the label value that carries no loss.
    vocab_axis: inside `jax.shard_map`, the mesh axis over which the projection's V is split
      (device `i` holds ids `[i * V/n, (i+1) * V/n)`); None: V is whole.

  Raises:
    ArgumentError: `block_size` or `vocab_block_size` not a positive int, labels not of the
      hidden states' leading shape, neither or both projections, or a projection whose E
      differs.
  """
  fn = "blocked_token_losses"
  for name, value in (("block_size", block_size), ("vocab_block_size", vocab_block_size)):
    if (value is not None or name == "block_size") and (
        isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise ArgumentError(f"{fn}: {name} must be a positive int, got {value!r}")
  if hidden_BxSxE.shape[:-1] != labels_BxS.shape:
    raise ArgumentError(f"{fn}: hidden_BxSxE shape {tuple(hidden_BxSxE.shape)} must be labels "
                        f"shape {tuple(labels_BxS.shape)} + (E,)")
  weight, tied = _projection(weight_ExV, embedding_VxE, hidden_BxSxE, fn)
  vocab = weight.shape[0 if tied else 1]
  chunk = min(vocab_block_size or vocab, vocab)
  plan = _Plan(tied=tied, vocab=vocab, chunk=chunk, chunks=-(-vocab // chunk),
               ignore_index=ignore_index, vocab_axis=vocab_axis)
  n, e = labels_BxS.size, hidden_BxSxE.shape[-1]
  block = max(1, min(block_size, n))
  blocks = -(-n // block)
  pad = blocks * block - n
  h_NxE = jnp.pad(hidden_BxSxE.reshape(n, e), ((0, pad), (0, 0)))
  labels_N = jnp.pad(labels_BxS.reshape(n), (0, pad), constant_values=ignore_index)
  loss_MxK = _blocked_losses(plan)(weight, h_NxE.reshape(blocks, block, e),
                                   labels_N.reshape(blocks, block))
  return loss_MxK.reshape(-1)[:n].reshape(labels_BxS.shape)


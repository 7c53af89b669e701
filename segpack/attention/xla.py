"""The XLA reference backend: attention with a dense `[S, S]` segment mask.

It runs everywhere and is the oracle for the other backends. It costs `S^2` per row and head
whatever the segments are: no block skipping.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from segpack import mesh as mesh_lib

_MASK_VALUE = -1e30


def segment_mask(segment_ids_BxS: jax.Array, *, causal: bool,
                 prefix_segment_ids_BxS: jax.Array | None = None) -> jax.Array:
  """The boolean `[B, S, T]` mask: same non-zero segment (or, with `prefix_segment_ids_BxS`, the
  key in the query's non-zero prefix segment) and, if causal, key not after query."""
  seg_k_BxT = mesh_lib.whole_slots(segment_ids_BxS)
  same_BxSxT = segment_ids_BxS[:, :, None] == seg_k_BxT[:, None, :]
  if prefix_segment_ids_BxS is not None:
    pre_BxSx1 = prefix_segment_ids_BxS[:, :, None]
    same_BxSxT |= (pre_BxSx1 == seg_k_BxT[:, None, :]) & (pre_BxSx1 != 0)
  mask_BxSxT = same_BxSxT & (segment_ids_BxS[:, :, None] != 0)
  if causal:
    s = segment_ids_BxS.shape[1]
    mask_BxSxT &= jnp.tril(jnp.ones((s, s), dtype=bool))[None]
  return mask_BxSxT


def segment_attention_xla(
    q_BxSxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    segment_ids_BxS: jax.Array,
    *,
    causal: bool,
    scale: float,
    prefix_segment_ids_BxS: jax.Array | None = None,
) -> jax.Array:
  """Dense-mask segment attention with native grouped-query heads.

  Logits and softmax are computed in float32; the probabilities are cast to the value dtype for the
  second matmul, as a flash kernel does. Padding queries (segment id 0) return zeros and get zero
  gradients.

  Args:
    q_BxSxHxD: queries.
    k_BxSxKxD: keys, H a multiple of K.
    v_BxSxKxD: values.
    segment_ids_BxS: integer segment ids, 0 = padding.
    causal: also mask keys after the query.
    scale: logit scale.
    prefix_segment_ids_BxS: optional shared-prefix ids: a query also sees the keys of its
      non-zero prefix segment (`segment_attention(prefix_segment_ids=...)`); None: not.

  Returns:
    `out_BxSxHxD` in the dtype of `q`.
  """
  mask_BxSxT = segment_mask(segment_ids_BxS, causal=causal,
                            prefix_segment_ids_BxS=prefix_segment_ids_BxS)
  return _masked_attention(q_BxSxHxD, mesh_lib.whole_slots(k_BxSxKxD), mesh_lib.whole_slots(v_BxSxKxD),
                           mask_BxSxT, segment_ids_BxS != 0, scale=scale)


def segment_attention_xla_slots(
    q_BxQxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    seg_q_BxQ: jax.Array,
    seg_k_BxS: jax.Array,
    slot_q_BxQ: jax.Array,
    slot_k_BxS: jax.Array,
    *,
    causal: bool,
    scale: float,
) -> jax.Array:
  """Dense-mask segment attention of `Q` queries over `S` keys placed by their slot indices.

  The mask is `seg_q[i] == seg_k[j] != 0` and, if causal, `slot_k[j] <= slot_q[i]`: the slot
  index is a slot's position in the row before any reordering (context parallelism), so neither
  the queries nor the keys need to be in row order.

  Args:
    q_BxQxHxD: queries (e.g. one device's share of a row).
    k_BxSxKxD: keys (e.g. the whole row, gathered), H a multiple of K.
    v_BxSxKxD: values.
    seg_q_BxQ: segment ids of the queries, 0 = padding.
    seg_k_BxS: segment ids of the keys.
    slot_q_BxQ: slot indices of the queries.
    slot_k_BxS: slot indices of the keys.
    causal: also mask keys whose slot index is above the query's.
    scale: logit scale.

  Returns:
    `out_BxQxHxD` in the dtype of `q`; zeros at padding queries.
  """
  mask_BxQxS = (seg_q_BxQ[:, :, None] == seg_k_BxS[:, None, :]) & (seg_q_BxQ[:, :, None] != 0)
  if causal:
    mask_BxQxS &= slot_k_BxS[:, None, :] <= slot_q_BxQ[:, :, None]
  return _masked_attention(q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxQxS, seg_q_BxQ != 0,
                           scale=scale)


def _masked_attention(q_BxSxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxSxT, valid_BxS, *, scale: float):
  """Softmax attention under a boolean `[B, S, T]` mask; zeros at the queries not `valid`."""
  b, s, h, d = q_BxSxHxD.shape
  kh = k_BxTxKxD.shape[2]
  q_BxSxKxGxD = q_BxSxHxD.reshape(b, s, kh, h // kh, d)
  logits_BxKxGxSxT = jnp.einsum(
      "bskgd,btkd->bkgst", q_BxSxKxGxD, k_BxTxKxD, preferred_element_type=jnp.float32) * scale
  logits_BxKxGxSxT = jnp.where(mask_BxSxT[:, None, None], logits_BxKxGxSxT, _MASK_VALUE)
  probs_BxKxGxSxT = jax.nn.softmax(logits_BxKxGxSxT, axis=-1)
  probs_BxKxGxSxT = jnp.where(valid_BxS[:, None, None, :, None], probs_BxKxGxSxT, 0.0)
  out_BxSxKxGxD = jnp.einsum(
      "bkgst,btkd->bskgd", probs_BxKxGxSxT.astype(v_BxTxKxD.dtype), v_BxTxKxD,
      preferred_element_type=jnp.float32)
  return out_BxSxKxGxD.reshape(b, s, h, d).astype(q_BxSxHxD.dtype)

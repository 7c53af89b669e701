"""The XLA reference backend: attention with a dense `[S, S]` segment mask.

It runs everywhere and is the oracle for the other backends. It costs `S^2` per row and head
whatever the segments are: no block skipping.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK_VALUE = -1e30


def segment_mask(segment_ids_BxS: jax.Array, *, causal: bool) -> jax.Array:
  """The boolean `[B, S, T]` mask: same non-zero segment and, if causal, key not after query."""
  same_BxSxT = segment_ids_BxS[:, :, None] == segment_ids_BxS[:, None, :]
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

  Returns:
    `out_BxSxHxD` in the dtype of `q`.
  """
  b, s, h, d = q_BxSxHxD.shape
  kh = k_BxSxKxD.shape[2]
  q_BxSxKxGxD = q_BxSxHxD.reshape(b, s, kh, h // kh, d)
  logits_BxKxGxSxT = jnp.einsum(
      "bskgd,btkd->bkgst", q_BxSxKxGxD, k_BxSxKxD, preferred_element_type=jnp.float32) * scale
  mask_BxSxT = segment_mask(segment_ids_BxS, causal=causal)
  logits_BxKxGxSxT = jnp.where(mask_BxSxT[:, None, None], logits_BxKxGxSxT, _MASK_VALUE)
  probs_BxKxGxSxT = jax.nn.softmax(logits_BxKxGxSxT, axis=-1)
  valid_BxS = segment_ids_BxS != 0
  probs_BxKxGxSxT = jnp.where(valid_BxS[:, None, None, :, None], probs_BxKxGxSxT, 0.0)
  out_BxSxKxGxD = jnp.einsum(
      "bkgst,btkd->bskgd", probs_BxKxGxSxT.astype(v_BxSxKxD.dtype), v_BxSxKxD,
      preferred_element_type=jnp.float32)
  return out_BxSxKxGxD.reshape(b, s, h, d).astype(q_BxSxHxD.dtype)

"""Token-level cross-entropy for packed batches, normalised by the global count of trained tokens.

A packed batch mixes documents of very different lengths in one row, so the only loss that treats
every trained token alike is `sum of token losses / number of trained tokens`, where the count is
taken over the *whole* (global, accumulated) batch. A mean of per-row, per-device or
per-micro-batch means would weight a token of a short document more than one of a long document.

The functions here take plain arrays and are exact under gradient accumulation and data
parallelism: count the trained tokens of the full batch once (`count_trained_tokens`), then pass
that count as `normalizer` to every micro-batch; the micro-batch losses (and their gradients) then
simply add up to the loss of the full batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IGNORE_INDEX = -100


def count_trained_tokens(labels_BxS: jax.Array, *, ignore_index: int = IGNORE_INDEX) -> jax.Array:
  """Returns the number of labels that carry loss (label != `ignore_index`), as float32.

  Args:
    labels_BxS: integer labels of any shape; `ignore_index` marks tokens without loss.
    ignore_index: the label value that carries no loss.
  """
  return jnp.sum(labels_BxS != ignore_index, dtype=jnp.float32)


def cross_entropy_sum(
    logits_BxSxV: jax.Array,
    labels_BxS: jax.Array,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[jax.Array, jax.Array]:
  """Returns `(sum of token cross-entropies, number of trained tokens)`, both float32 scalars.

  The log-softmax is computed in float32 whatever the dtype of the logits. Labels equal to
  `ignore_index` contribute nothing (and no gradient); every other label must lie in `[0, V)`.

  Args:
    logits_BxSxV: unnormalised scores, `[..., V]`.
    labels_BxS: integer targets with the leading shape of the logits.
    ignore_index: the label value that carries no loss.

  Raises:
    ValueError: the shapes of logits and labels do not line up.
  """
  if logits_BxSxV.shape[:-1] != labels_BxS.shape:
    raise ValueError(
        f"cross_entropy_sum: logits shape {tuple(logits_BxSxV.shape)} must be labels shape "
        f"{tuple(labels_BxS.shape)} + (vocab,)")
  logits = logits_BxSxV.astype(jnp.float32)
  mask_BxS = labels_BxS != ignore_index
  safe_labels_BxS = jnp.where(mask_BxS, labels_BxS, 0)
  log_z_BxS = jax.nn.logsumexp(logits, axis=-1)
  target_BxS = jnp.take_along_axis(logits, safe_labels_BxS[..., None], axis=-1)[..., 0]
  token_loss_BxS = jnp.where(mask_BxS, log_z_BxS - target_BxS, 0.0)
  return jnp.sum(token_loss_BxS), jnp.sum(mask_BxS, dtype=jnp.float32)


def cross_entropy_loss(
    logits_BxSxV: jax.Array,
    labels_BxS: jax.Array,
    *,
    normalizer: jax.Array | float | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy that ignores `ignore_index` labels, divided by a global token count.

  Args:
    logits_BxSxV: unnormalised scores, `[..., V]`.
    labels_BxS: integer targets with the leading shape of the logits; `-100` = no loss.
    normalizer: the number of trained tokens of the *global* batch this slice belongs to (from
      `count_trained_tokens` on the full accumulated batch). `None` uses this slice's own count,
      which is the right value when the slice is the whole batch. A batch without any trained
      token gives a loss of 0, not NaN.
    ignore_index: the label value that carries no loss.

  Returns:
    `(loss, num_tokens)`: `sum of token losses / normalizer` and this slice's count of trained
    tokens (float32 scalars).

  Example:
    >>> total = count_trained_tokens(labels)              # the whole batch
    >>> loss = sum(cross_entropy_loss(lo, la, normalizer=total)[0]
    ...            for lo, la in micro_batches)          # == cross_entropy_loss(all, labels)[0]
  """
  loss_sum, num_tokens = cross_entropy_sum(logits_BxSxV, labels_BxS, ignore_index=ignore_index)
  denominator = num_tokens if normalizer is None else jnp.asarray(normalizer, jnp.float32)
  return loss_sum / jnp.maximum(denominator, 1.0), num_tokens

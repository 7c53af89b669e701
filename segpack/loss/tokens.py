"""Cross-entropy for packed batches, normalised by a global count of trained tokens or documents.

A packed batch mixes documents of very different lengths in one row, so the only loss that treats
every trained token alike is `sum of token losses / number of trained tokens`, where the count is
taken over the *whole* (global, accumulated) batch. A mean of per-row, per-device or
per-micro-batch means would weight a token of a short document more than one of a long document.

The functions here take plain arrays and are exact under gradient accumulation and data
parallelism: count the trained tokens of the full batch once (`count_trained_tokens`), then pass
that count as `normalizer` to every micro-batch; the micro-batch losses (and their gradients) then
simply add up to the loss of the full batch.

A loss is two steps: every token's loss (`token_cross_entropy` of the logits, or
`segpack.loss.blocks.blocked_token_losses` of the final hidden states, without the full
logits), then its weighting (`token_loss_sum`, `token_loss_by_source`), which reads token losses
from either. `cross_entropy_loss` is the two of the logits, divided by the normaliser.

Two weightings (`weighting=`):
  * `"token"` (the default): every trained token alike, `sum of token losses / trained tokens`.
  * `"sequence"`: every document alike, the mean over documents of (document loss / document
    trained tokens), what unpacked per-sequence training computes. The documents are the
    segments of the rows (`segment_ids_BxS`, 1..n per row, 0 on padding); a segment's trained
    tokens are its labels other than `ignore_index`, and segments without any are left out of the
    mean. The per-segment counts are derived here, from `segment_ids_BxS` and the labels, by a
    per-row segment sum (`[B, S+1]` counts: O(B*S) memory, jit-friendly, no `[B, S, S]`); they
    need no extra row feature. The normaliser is the number of such documents in the global batch
    (`count_trained_documents`), passed to every micro-batch as above, so accumulation stays
    exact. A document split across rows appears as several segments and each chunk weighs as its
    own sequence, as unpacked training on the same chunks would weigh it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from segpack import mesh as mesh_lib
from segpack.errors import ArgumentError
from segpack.loss.labels import IGNORE_INDEX

WEIGHTINGS = ("token", "sequence")


def count_trained_tokens(labels_BxS: jax.Array, *, ignore_index: int = IGNORE_INDEX) -> jax.Array:
  """Returns the number of labels that carry loss (label != `ignore_index`), as float32.

  Args:
    labels_BxS: integer labels of any shape; `ignore_index` marks tokens without loss.
    ignore_index: the label value that carries no loss.
  """
  return jnp.sum(labels_BxS != ignore_index, dtype=jnp.float32)


def check_weighting(weighting: str, *, name: str = "weighting") -> str:
  """Returns `weighting` if it is one of `WEIGHTINGS`, else raises an ArgumentError (a
  ValueError) naming `name`."""
  if weighting not in WEIGHTINGS:
    raise ArgumentError(f"{name} must be one of {list(WEIGHTINGS)}, got {weighting!r}")
  return weighting


def _check_segments(labels_BxS: jax.Array, segment_ids_BxS: jax.Array | None, fn: str) -> None:
  if segment_ids_BxS is None:
    raise ArgumentError(f"{fn}: weighting='sequence' needs segment_ids_BxS (got None)")
  if labels_BxS.ndim != 2 or segment_ids_BxS.shape != labels_BxS.shape:
    raise ArgumentError(
        f"{fn}: segment_ids_BxS shape {tuple(segment_ids_BxS.shape)} must equal labels shape "
        f"{tuple(labels_BxS.shape)}, and both must be [B, S]")


def document_token_counts(
    labels_BxS: jax.Array,
    *,
    segment_ids_BxS: jax.Array,
    ignore_index: int = IGNORE_INDEX,
) -> jax.Array:
  """Returns the trained tokens of every segment, float32 `[B, S+1]` (column `n` = segment `n`).

  Column 0 (padding) is always 0: labels on padding slots carry no loss in either weighting's
  documents. Computed per row by a segment sum over `S+1` static buckets (O(B*S) memory); on a
  mesh with explicit axes over the row's slots gathered first (`segpack.mesh.whole_slots`), the
  counts split by rows only.

  Args:
    labels_BxS: integer labels `[B, S]`; `ignore_index` marks tokens without loss.
    segment_ids_BxS: segment ids `[B, S]`, 1..n per row, 0 on padding.
    ignore_index: the label value that carries no loss.
  """
  _check_segments(labels_BxS, segment_ids_BxS, "document_token_counts")
  num_buckets = labels_BxS.shape[1] + 1
  seg_BxS = jnp.clip(segment_ids_BxS, 0, num_buckets - 1)
  trained_BxS = ((labels_BxS != ignore_index) & (seg_BxS != 0)).astype(jnp.float32)
  return jax.vmap(lambda t_S, s_S: jax.ops.segment_sum(t_S, s_S, num_segments=num_buckets))(
      mesh_lib.whole_slots(trained_BxS), mesh_lib.whole_slots(seg_BxS))


def count_trained_documents(
    labels_BxS: jax.Array,
    *,
    segment_ids_BxS: jax.Array,
    ignore_index: int = IGNORE_INDEX,
) -> jax.Array:
  """Returns the number of segments with at least one trained token, as float32.

  Args:
    labels_BxS: integer labels `[B, S]`; `ignore_index` marks tokens without loss.
    segment_ids_BxS: segment ids `[B, S]`, 1..n per row, 0 on padding.
    ignore_index: the label value that carries no loss.
  """
  counts_BxN = document_token_counts(labels_BxS, segment_ids_BxS=segment_ids_BxS,
                                    ignore_index=ignore_index)
  return jnp.sum(counts_BxN > 0, dtype=jnp.float32)


def loss_normalizer(
    labels_BxS: jax.Array,
    *,
    weighting: str = "token",
    segment_ids_BxS: jax.Array | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> jax.Array:
  """The `normalizer` of `cross_entropy_loss` for a whole (global) batch, float32.

  `weighting="token"`: `count_trained_tokens`; `"sequence"`: `count_trained_documents`.

  Args:
    labels_BxS: integer labels `[B, S]` of the whole batch.
    weighting: `"token"` or `"sequence"` (module docstring).
    segment_ids_BxS: segment ids `[B, S]`; required for `"sequence"`.
    ignore_index: the label value that carries no loss.
  """
  if check_weighting(weighting) == "token":
    return count_trained_tokens(labels_BxS, ignore_index=ignore_index)
  _check_segments(labels_BxS, segment_ids_BxS, "loss_normalizer")
  return count_trained_documents(labels_BxS, segment_ids_BxS=segment_ids_BxS,
                                 ignore_index=ignore_index)


def token_cross_entropy(logits_BxSxV: jax.Array, labels_BxS: jax.Array, *,
                        ignore_index: int = IGNORE_INDEX) -> jax.Array:
  """Every token's cross-entropy, float32 `[B, S]`: 0 (and no gradient) where the label is
  `ignore_index`. The log-softmax is computed in float32 whatever the dtype of the logits.

  Args:
    logits_BxSxV: unnormalised scores `[..., V]`.
    labels_BxS: integer targets with the leading shape of the logits, in `[0, V)` or
      `ignore_index`.
    ignore_index: the label value that carries no loss.
  """
  return _token_losses(logits_BxSxV, labels_BxS, ignore_index, "token_cross_entropy")


def _token_losses(logits_BxSxV: jax.Array, labels_BxS: jax.Array, ignore_index: int,
                  fn: str) -> jax.Array:
  """Token cross-entropy `[B, S]`; 0 loss where the label is ignored."""
  if logits_BxSxV.shape[:-1] != labels_BxS.shape:
    raise ArgumentError(
        f"{fn}: logits shape {tuple(logits_BxSxV.shape)} must be labels shape "
        f"{tuple(labels_BxS.shape)} + (vocab,)")
  logits = logits_BxSxV.astype(jnp.float32)
  mask_BxS = labels_BxS != ignore_index
  safe_labels_BxS = jnp.where(mask_BxS, labels_BxS, 0)
  log_z_BxS = jax.nn.logsumexp(logits, axis=-1)
  target_BxS = jnp.take_along_axis(logits, safe_labels_BxS[..., None], axis=-1)[..., 0]
  return jnp.where(mask_BxS, log_z_BxS - target_BxS, 0.0)


def _check_token_losses(token_loss_BxS: jax.Array, labels_BxS: jax.Array, fn: str) -> None:
  if token_loss_BxS.shape != labels_BxS.shape:
    raise ArgumentError(f"{fn}: token_loss_BxS shape {tuple(token_loss_BxS.shape)} must equal "
                        f"labels shape {tuple(labels_BxS.shape)}")


def token_loss_by_source(
    token_loss_BxS: jax.Array,
    labels_BxS: jax.Array,
    sources_BxS: jax.Array,
    *,
    num_sources: int,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[jax.Array, jax.Array]:
  """Per mixture source: `(sum of token losses, trained tokens)`, float32 `[N]` each.

  A trained token counts for the source of its slot (`sources_BxS`, the rows'
  `segment_sources`: 0..N-1, -1 on padding); `sum / tokens` is the source's mean token loss.

  Args:
    token_loss_BxS: every token's cross-entropy, float32, 0 where the label is ignored
      (`token_cross_entropy`, or the blocked `segpack.loss.blocks.blocked_token_losses`).
    labels_BxS: integer targets; `ignore_index` carries no loss.
    sources_BxS: integer source of every slot, -1 (or anything outside `[0, N)`) for none.
    num_sources: N.
    ignore_index: the label value that carries no loss.
  """
  _check_token_losses(token_loss_BxS, labels_BxS, "token_loss_by_source")
  mask_BxS = labels_BxS != ignore_index
  valid_BxS = mask_BxS & (sources_BxS >= 0) & (sources_BxS < num_sources)
  # On a mesh with explicit axes the [B, S] arrays are gathered whole first (a few bytes per
  # slot, never the logits): a scatter of split indices into N buckets has no sharding to infer.
  valid_BxS, token_loss_BxS = mesh_lib.replicated(valid_BxS), mesh_lib.replicated(token_loss_BxS)
  bucket = jnp.where(valid_BxS, mesh_lib.replicated(sources_BxS), num_sources).reshape(-1)
  sums = jax.ops.segment_sum(token_loss_BxS.reshape(-1), bucket, num_segments=num_sources + 1)
  counts = jax.ops.segment_sum(valid_BxS.reshape(-1).astype(jnp.float32), bucket,
                               num_segments=num_sources + 1)
  return sums[:num_sources], counts[:num_sources]


def token_loss_sum(
    token_loss_BxS: jax.Array,
    labels_BxS: jax.Array,
    *,
    weighting: str = "token",
    segment_ids_BxS: jax.Array | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[jax.Array, jax.Array]:
  """Returns `(weighted sum of token losses, count)`, both float32 scalars.

  `weighting="token"`: the plain sum and the number of trained tokens. `"sequence"`: the sum
  over documents (segments) of their mean token loss, and the number of documents with trained
  tokens; dividing the two gives the mean of per-document means.

  Args:
    token_loss_BxS: every token's cross-entropy, float32, 0 where the label is ignored
      (`token_cross_entropy`, or the blocked `segpack.loss.blocks.blocked_token_losses`).
    labels_BxS: integer targets of the token losses' shape; `ignore_index` carries no loss.
    weighting: `"token"` or `"sequence"` (module docstring).
    segment_ids_BxS: segment ids `[B, S]`, 1..n per row, 0 on padding; required for
      `"sequence"`, unused for `"token"`.
    ignore_index: the label value that carries no loss.

  Raises:
    ArgumentError: the shapes of token losses, labels and segment ids do not line up, an
      unknown `weighting`, or `"sequence"` without `segment_ids_BxS`.
  """
  check_weighting(weighting)
  _check_token_losses(token_loss_BxS, labels_BxS, "token_loss_sum")
  if weighting == "token":
    return (jnp.sum(token_loss_BxS),
            jnp.sum(labels_BxS != ignore_index, dtype=jnp.float32))
  _check_segments(labels_BxS, segment_ids_BxS, "token_loss_sum")
  counts_BxN = document_token_counts(labels_BxS, segment_ids_BxS=segment_ids_BxS,
                                     ignore_index=ignore_index)
  seg_BxS = jnp.clip(segment_ids_BxS, 0, counts_BxN.shape[1] - 1)
  # (each row's counts are whole on its devices; the slots they are read for, too)
  doc_count_BxS = jnp.take_along_axis(counts_BxN, mesh_lib.whole_slots(seg_BxS), axis=1)
  # Tokens on padding (segment 0) have doc_count 0 and get weight 0.
  weight_BxS = jnp.where(doc_count_BxS > 0, 1.0 / jnp.maximum(doc_count_BxS, 1.0), 0.0)
  return jnp.sum(token_loss_BxS * weight_BxS), jnp.sum(counts_BxN > 0, dtype=jnp.float32)


def cross_entropy_loss(
    logits_BxSxV: jax.Array,
    labels_BxS: jax.Array,
    *,
    normalizer: jax.Array | float | None = None,
    weighting: str = "token",
    segment_ids_BxS: jax.Array | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy that ignores `ignore_index` labels, divided by a global count:
  `token_loss_sum` of `token_cross_entropy`, over `normalizer`.

  The log-softmax is computed in float32 whatever the dtype of the logits. Labels equal to
  `ignore_index` contribute nothing (and no gradient); every other label must lie in `[0, V)`.

  Args:
    logits_BxSxV: unnormalised scores, `[..., V]` (`[B, S, V]` for `"sequence"`).
    labels_BxS: integer targets with the leading shape of the logits; `ignore_index` (-100) =
      no loss.
    normalizer: the count of the *global* batch this slice belongs to (`loss_normalizer` on the
      full accumulated batch, with the same `weighting`: trained tokens for `"token"`, documents
      with trained tokens for `"sequence"`). `None` uses this slice's own count, which is the
      right value when the slice is the whole batch. A batch without any trained token gives a
      loss of 0, not NaN.
    weighting: `"token"` (every trained token alike) or `"sequence"` (every document alike: the
      mean of per-document means); see the module docstring.
    segment_ids_BxS: segment ids `[B, S]`, 1..n per row, 0 on padding; required for
      `"sequence"`, unused for `"token"`.
    ignore_index: the label value that carries no loss.

  Returns:
    `(loss, count)`: `weighted sum of token losses / normalizer` and this slice's count (trained
    tokens for `"token"`, documents with trained tokens for `"sequence"`), float32 scalars.

  Raises:
    ArgumentError: the shapes of logits, labels and segment ids do not line up, an unknown
      `weighting`, or `"sequence"` without `segment_ids_BxS`.

  Example:
    >>> total = loss_normalizer(labels, weighting=w, segment_ids_BxS=seg)  # the whole batch
    >>> loss = sum(cross_entropy_loss(lo, la, normalizer=total, weighting=w,
    ...                               segment_ids_BxS=sg)[0]
    ...            for lo, la, sg in micro_batches)  # == cross_entropy_loss(all, ...)[0]
  """
  check_weighting(weighting)
  token_loss_BxS = _token_losses(logits_BxSxV, labels_BxS, ignore_index, "cross_entropy_loss")
  loss_sum, count = token_loss_sum(token_loss_BxS, labels_BxS, weighting=weighting,
                                   segment_ids_BxS=segment_ids_BxS, ignore_index=ignore_index)
  denominator = count if normalizer is None else jnp.asarray(normalizer, jnp.float32)
  return loss_sum / jnp.maximum(denominator, 1.0), count

"""Every token's loss of a trainer batch: from the full logits, or in blocks (`loss.block_size`).

With `block_size=0` the decoder's float32 logits `[B, S, V]` are made whole and
`segpack.loss.token_cross_entropy` reads them. With `block_size > 0` the decoder stops at its
final hidden states `[B, S, E]` and `segpack.loss.blocked_token_losses` projects them
through the head's weight a block of positions at a time (and `vocab_block_size` columns of
the vocabulary at a time when > 0), so neither pass holds more than a block's logits. Both give
the same float32 `[B, S]` token losses, which the weightings and per-source sums then read
alike (`segpack.loss.token_loss_sum`, `token_loss_by_source`).

On a mesh of explicit axes (`train.model.layout`) the blocked loss runs per device under
`jax.shard_map`: every device takes its rows and slots of the hidden states and labels (split
as the batch is), and the head's weight gathered over `fsdp`, its vocabulary split over
`tensor` when V divides by it (`Layout.split`, as the full head splits its logits). With the
vocabulary split, each device computes its share of every block's logits and the blocked loss
combines the logsumexp and the label logit over `tensor` (`vocab_axis`); `block_size` then
counts each device's positions.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from segpack import loss as loss_lib
from train.model import layout as layout_lib


def token_losses(model: Any, batch: dict[str, jax.Array], *, block_size: int,
                 vocab_block_size: int = 0, temperature: float = 1.0) -> jax.Array:
  """The float32 `[B, S]` cross-entropy of every token of `batch` (0 where the label is -100).

  Args:
    model: a `train.model.decoder.Decoder`.
    batch: a trainer batch (`input_ids`, `labels`, `segment_ids`, `segment_positions`, and
      `slot_index` in context order).
    block_size: positions per block of the blocked loss (per device on a mesh); 0: the full
      logits (`Decoder.batch_logits`).
    vocab_block_size: with `block_size > 0`, vocabulary columns per chunk; 0: the whole
      vocabulary (of this device, on a mesh that splits it).
    temperature: the logits are divided by it first (a sampler's temperature, for the log-probs
      an RL objective compares with the sampler's; the head has no bias, so dividing the final
      hidden states is the same).
  """
  labels_BxS = batch["labels"]
  if block_size == 0:
    logits_BxSxV = model.batch_logits(batch)
    if temperature != 1.0:
      logits_BxSxV = logits_BxSxV / temperature
    return loss_lib.token_cross_entropy(logits_BxSxV, labels_BxS)
  hidden_BxSxE = model.batch_logits(batch, logits=False)
  if temperature != 1.0:
    hidden_BxSxE = hidden_BxSxE / temperature
  weight, tied = model.head_weight()
  name = "embedding_VxE" if tied else "weight_ExV"
  options = dict(block_size=block_size, vocab_block_size=vocab_block_size or None)
  layout = layout_lib.layout_of(hidden_BxSxE)
  if layout is None:
    return loss_lib.blocked_token_losses(hidden_BxSxE, labels_BxS, **options,
                                         **{name: weight})
  split = layout.split(weight.shape[0 if tied else 1])
  weight_spec = P(split, None) if tied else P(None, split)
  rows_spec = P(layout.rows, layout.slots)
  hidden_spec = P(layout.rows, layout.slots, None)

  def per_device(h_BxSxE, w, labels):
    return loss_lib.blocked_token_losses(h_BxSxE, labels, **options, vocab_axis=split,
                                         **{name: w})

  return jax.shard_map(per_device, mesh=layout.mesh,
                       in_specs=(hidden_spec, weight_spec, rows_spec), out_specs=rows_spec)(
                           layout.put(hidden_BxSxE, *hidden_spec), layout.put(weight, *weight_spec),
                           layout.put(labels_BxS, *rows_spec))

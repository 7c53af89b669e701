"""The train and eval steps' loss on preference rows: one loss per pair, summed per segment.

`PreferenceObjective` is a `train.objective.Objective`: its rows are whole pairs
(`train.preference.data`), it scores a reference before step 1 when the loss needs one
(`train.preference.reference`), and the loss of a step is the mean over its pairs (the global
batch's count, so micro-batches sum to it), from
each sequence's summed completion log-probs (`segpack.loss.preference`). The token losses come
from `train.model.head_loss` (full or blocked logits), so large vocabularies cost what they cost SFT.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from segpack.loss import preference as preference_loss
from train.model import head_loss
from train.preference import data as preference_data
from train.preference import reference as preference_reference
from train.preference import scoring

__all__ = ["METRICS", "PreferenceObjective", "from_config"]

# The per-pair means a step reports (beside `loss`), as `metrics.jsonl` names them.
METRICS = ("reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin",
           "logp_chosen", "logp_rejected")


@dataclasses.dataclass(frozen=True)
class PreferenceObjective:
  """A preference loss (`preference.*` keys) over the token losses of a batch.

  Attributes:
    pair_loss: the loss and its settings (`segpack.loss.preference.PreferenceLoss`).
    blocks: `train.model.head_loss.token_losses`'s `block_size` and `vocab_block_size` (`loss.*`).
  """

  pair_loss: preference_loss.PreferenceLoss
  blocks: tuple[int, int] = (0, 0)

  @property
  def needs_reference(self) -> bool:
    return self.pair_loss.needs_reference

  def make_data(self, config: Any, *, mesh: Any, batch_size: int, process_index: int,
                process_count: int) -> tuple[Any, preference_data.Splits]:
    """The run's pair rows and their splits (`train.preference.data`)."""
    del mesh  # every process reads its rows of each batch of pairs
    return preference_data.make_preference_data(config, batch_size=batch_size,
                                                process_index=process_index,
                                                process_count=process_count)

  def prepare(self, prepared: Any) -> tuple["PreferenceObjective", str | None]:
    """The reference scores of every split when the loss needs them (before step 1)."""
    if not self.needs_reference:
      return self, None
    step = scoring.make_score_step(prepared.graphdef, block_size=self.blocks[0],
                                   vocab_block_size=self.blocks[1])
    return self, preference_reference.prepare(
        prepared.config, prepared.workdir, prepared.extra, step=step,
        params=prepared.reference_params(), mesh=prepared.mesh, resumed=prepared.resumed)

  def batch_sharding(self, mesh: Any) -> None:
    """Pair rows arrive laid out by the data (their `[B, J]` pair features with them)."""
    del mesh
    return None

  def normalizer(self, batch: dict[str, jax.Array]) -> jax.Array:
    """The pairs of the (global) batch."""
    return jnp.sum(batch["pair_index"] >= 0, dtype=jnp.float32)

  def zeros(self) -> dict[str, jax.Array]:
    """The sums of a batch with no pair (`loss_and_sums`'s second value)."""
    return {name: jnp.float32(0) for name in (*METRICS, "loss_sum")}

  def pair_terms(self, model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per pair `[B, J]`: the loss, rewards and log-probs, and `valid` (a pair is there)."""
    token_loss_BxS = head_loss.token_losses(model, batch, block_size=self.blocks[0],
                                            vocab_block_size=self.blocks[1])
    sums = preference_loss.pair_logps(-token_loss_BxS, batch["labels"], batch["segment_ids"],
                                      batch["pair_chosen_segment"],
                                      batch["pair_rejected_segment"])
    refs = {}
    if self.needs_reference:
      refs = dict(ref_chosen_logp=batch["ref_chosen_logp"],
                  ref_rejected_logp=batch["ref_rejected_logp"])
    terms = self.pair_loss(**sums, **refs)
    return dict(terms, **sums, valid=batch["pair_index"] >= 0)

  def loss_and_sums(self, model: Any, batch: dict[str, jax.Array],
                    total: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(summed pair losses / total, metric sums)` of a (micro-)batch."""
    t = self.pair_terms(model, batch)
    valid = t["valid"]

    def total_of(x):
      return jnp.sum(jnp.where(valid, x, 0.0))

    margin = t["chosen_reward"] - t["rejected_reward"]
    sums = dict(reward_chosen=total_of(t["chosen_reward"]),
                reward_rejected=total_of(t["rejected_reward"]),
                reward_accuracy=total_of((margin > 0).astype(jnp.float32)),
                reward_margin=total_of(margin), logp_chosen=total_of(t["chosen_logp"]),
                logp_rejected=total_of(t["rejected_logp"]))
    loss_sum = total_of(t["loss"])
    sums = jax.tree.map(jax.lax.stop_gradient, sums)
    return loss_sum / jnp.maximum(total, 1.0), dict(sums, loss_sum=jax.lax.stop_gradient(
        loss_sum))


  def eval_sums(self, model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The summed pair losses and metrics of a held-out batch, over its pairs (`count`)."""
    count = self.normalizer(batch)
    return dict(self.loss_and_sums(model, batch, count)[1], count=count)

  def window_means(self, window: list[dict[str, Any]], counts: float) -> dict[str, Any]:
    """The per-pair means of `METRICS` over the window's pairs."""
    return {name: sum(float(m[name]) for m in window) / max(counts, 1.0) for name in METRICS}

  def describe(self, record: dict[str, Any], prefix: str = "") -> str:
    """The reward accuracy and margin."""
    return (f" | reward acc {record[prefix + 'reward_accuracy']:.1%}, margin "
            f"{record[prefix + 'reward_margin']:.4f}")


def from_config(config: Any) -> PreferenceObjective:
  """The objective of `preference.loss`."""
  p = config.preference
  return PreferenceObjective(
      pair_loss=preference_loss.PreferenceLoss(
          loss=p.loss, beta=float(p.beta), label_smoothing=float(p.label_smoothing),
          simpo_gamma=float(p.simpo_gamma)),
      blocks=(int(config.loss.block_size), int(config.loss.vocab_block_size)))

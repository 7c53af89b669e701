"""Preference losses on packed rows: each sequence's log-probability summed over its segment.

Rows from `segpack.data.pairs.pack_pairs` hold whole pairs; `pair_chosen_segment_BxJ` and
`pair_rejected_segment_BxJ` name the segments of a row's pairs. `pair_logps` sums the trained
tokens' log-probabilities of every such segment (its completion: the labels not `IGNORE_INDEX`,
-100), and `pair_losses` turns them into one loss per pair:

- `dpo` (Rafailov et al. 2023), with conservative label smoothing `eps`:
  `-(1 - eps) log s(b d) - eps log s(-b d)`, `d = (c - c_ref) - (r - r_ref)`;
- `ipo` (Azar et al. 2023), on log-ratios averaged per completion token as TRL does:
  `(d_avg - 1 / (2 b))^2`;
- `simpo` (Meng et al. 2024), reference-free: `-log s(b (c / |c| - r / |r|) - gamma)`;
- `orpo` (Hong et al. 2024), reference-free: the chosen completion's mean token NLL
  `- b log s(log odds(c_avg) - log odds(r_avg))`, `odds(x) = e^x / (1 - e^x)`.

`c`, `r` are the policy's summed log-probs of the chosen and rejected completions, `|c|`, `|r|`
their trained tokens, `s` the logistic sigmoid, `b` = `beta`. Rewards (for metrics):
`b (c - c_ref)` with a reference, `b c / |c|` without.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from segpack.errors import ArgumentError
from segpack.loss.labels import IGNORE_INDEX

__all__ = ["LOSSES", "PreferenceLoss", "REFERENCE_FREE", "check_loss", "pair_logps",
           "pair_losses"]

LOSSES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


def check_loss(loss: str, *, name: str = "loss") -> str:
  """`loss` if it is one of `LOSSES`, else an ArgumentError (a ValueError) naming `name` and
  the value."""
  if loss not in LOSSES:
    raise ArgumentError(f"{name} must be one of {list(LOSSES)}, got {loss!r}")
  return loss


def pair_logps(token_logp_BxS: jax.Array, labels_BxS: jax.Array, segment_ids_BxS: jax.Array,
               chosen_segment_BxJ: jax.Array, rejected_segment_BxJ: jax.Array,
               ) -> dict[str, jax.Array]:
  """Per pair: summed log-probs and trained-token counts of its chosen and rejected segments.

  Args:
    token_logp_BxS: float32 log-probability of every slot's label (any value where ignored).
    labels_BxS: the labels; slots with `IGNORE_INDEX` are not summed.
    segment_ids_BxS: the rows' segment ids.
    chosen_segment_BxJ, rejected_segment_BxJ: the segment id of pair `j` of each row's chosen
      and rejected sequence (0: no pair `j`).

  Returns:
    `chosen_logp`, `rejected_logp`, `chosen_tokens`, `rejected_tokens`: float32 `[B, J]`
    (0 where there is no pair).
  """
  trained_BxS = (labels_BxS != IGNORE_INDEX).astype(jnp.float32)
  logp_BxS = jnp.where(trained_BxS > 0, token_logp_BxS.astype(jnp.float32), 0.0)
  out = {}
  for name, seg_BxJ in (("chosen", chosen_segment_BxJ), ("rejected", rejected_segment_BxJ)):
    in_BxJxS = ((segment_ids_BxS[:, None, :] == seg_BxJ[:, :, None])
                & (seg_BxJ[:, :, None] > 0))
    out[f"{name}_logp"] = jnp.sum(jnp.where(in_BxJxS, logp_BxS[:, None, :], 0.0), axis=-1)
    out[f"{name}_tokens"] = jnp.sum(jnp.where(in_BxJxS, trained_BxS[:, None, :], 0.0), axis=-1)
  return out


def _log_odds(mean_logp: jax.Array) -> jax.Array:
  """`log(p / (1 - p))` of `p = exp(mean_logp)`, stable for `mean_logp < 0`."""
  return mean_logp - jnp.log1p(-jnp.exp(jnp.minimum(mean_logp, -1e-7)))


def pair_losses(*, loss: str, chosen_logp: jax.Array, rejected_logp: jax.Array,
                chosen_tokens: jax.Array, rejected_tokens: jax.Array,
                ref_chosen_logp: jax.Array | None = None,
                ref_rejected_logp: jax.Array | None = None, beta: float = 0.1,
                label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                ) -> dict[str, jax.Array]:
  """Every pair's loss and rewards (arrays of any one shape; mask unused pairs afterwards).

  Args:
    loss: one of `LOSSES`.
    chosen_logp, rejected_logp: the policy's summed completion log-probs.
    chosen_tokens, rejected_tokens: the completions' trained tokens.
    ref_chosen_logp, ref_rejected_logp: the reference's (required for "dpo" and "ipo").
    beta: the losses' `b`.
    label_smoothing: "dpo": the share `eps` of flipped labels (0: plain DPO).
    simpo_gamma: "simpo": the target margin `gamma`.

  Returns:
    `loss`, `chosen_reward`, `rejected_reward`: float32, the shape of the inputs.

  Raises:
    ArgumentError: an unknown `loss`, or "dpo" or "ipo" without the reference's log-probs.
  """
  check_loss(loss)
  c_avg = chosen_logp / jnp.maximum(chosen_tokens, 1.0)
  r_avg = rejected_logp / jnp.maximum(rejected_tokens, 1.0)
  if loss in REFERENCE_FREE:
    chosen_reward, rejected_reward = beta * c_avg, beta * r_avg
    if loss == "simpo":
      per_pair = -jax.nn.log_sigmoid(chosen_reward - rejected_reward - simpo_gamma)
    else:
      per_pair = -c_avg - beta * jax.nn.log_sigmoid(_log_odds(c_avg) - _log_odds(r_avg))
    return dict(loss=per_pair, chosen_reward=chosen_reward, rejected_reward=rejected_reward)
  if ref_chosen_logp is None or ref_rejected_logp is None:
    missing = [name for name, value in (("ref_chosen_logp", ref_chosen_logp),
                                        ("ref_rejected_logp", ref_rejected_logp)) if value is None]
    raise ArgumentError(f"loss={loss!r} needs the reference's log-probs, got "
                        f"{' and '.join(f'{name}=None' for name in missing)}")
  chosen_ratio = chosen_logp - ref_chosen_logp
  rejected_ratio = rejected_logp - ref_rejected_logp
  if loss == "dpo":
    d = beta * (chosen_ratio - rejected_ratio)
    per_pair = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(d)
                - label_smoothing * jax.nn.log_sigmoid(-d))
  else:  # ipo
    d = (chosen_ratio / jnp.maximum(chosen_tokens, 1.0)
         - rejected_ratio / jnp.maximum(rejected_tokens, 1.0))
    per_pair = (d - 1.0 / (2.0 * beta)) ** 2
  return dict(loss=per_pair, chosen_reward=beta * chosen_ratio,
              rejected_reward=beta * rejected_ratio)


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
  """A preference loss and its settings, as `pair_losses` takes them.

  Attributes:
    loss: one of `LOSSES`.
    beta: the loss's `b`.
    label_smoothing: "dpo": the share of flipped labels.
    simpo_gamma: "simpo": the target margin.
  """

  loss: str
  beta: float = 0.1
  label_smoothing: float = 0.0
  simpo_gamma: float = 0.5

  def __post_init__(self):
    check_loss(self.loss)

  @property
  def needs_reference(self) -> bool:
    return self.loss not in REFERENCE_FREE

  def __call__(self, **scores: jax.Array) -> dict[str, jax.Array]:
    """`pair_losses` with these settings (`scores`: its log-prob and token arguments)."""
    return pair_losses(loss=self.loss, beta=self.beta, label_smoothing=self.label_smoothing,
                       simpo_gamma=self.simpo_gamma, **scores)

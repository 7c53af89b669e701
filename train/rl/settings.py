"""An RL run's settings: the `rl.*` keys' combination checks and the defaults each loss implies.

Defaults by loss, as the papers and TRL's `GRPOConfig` have them: `dr_grpo` divides advantages by
nothing (`scale_rewards="none"`), the others by the group's std; `dapo` clips higher
(`epsilon_high=0.28`), drops groups of equal rewards and masks truncated completions; `rloo` is
GRPO's loss with the leave-one-out advantage, never scaled.
"""

from __future__ import annotations

from typing import Any

from segpack.errors import UserError
from segpack.loss import policy as policy_loss
from train.rollout.sampling import Sampling

DAPO_EPSILON_HIGH = 0.28  # DAPO's clip-higher bound


class RLConfigError(UserError, ValueError):
  """`rl.*` keys that do not combine with each other or with the rest of the config."""


def check(config: Any) -> None:
  """Checks the keys an RL loss does not combine with (`train.config_checks` checks each key's
  own values).

  Raises:
    RLConfigError: an RL loss with a preference loss, packing.mode="minibatch", mesh.context > 1
      or a segment cap; one completion per prompt with its advantage divided by a group's std
      (always 0: nothing to learn), or rloo's leave-one-out (no other completion).
  """
  r = config.rl
  if r.loss == "none":
    return
  clash = [(k, v) for k, v, ok in (
      ("preference.loss", config.preference.loss, config.preference.loss == "none"),
      ("packing.mode", config.packing.mode, config.packing.mode == "global"),
      ("mesh.context", config.mesh.context, config.mesh.context == 1),
      ("packing.max_segments_per_row", config.packing.max_segments_per_row,
       config.packing.max_segments_per_row is None)) if not ok]
  if clash:
    key, value = clash[0]
    raise RLConfigError(
        f"rl.loss={r.loss!r} with {key}={value!r}: an RL loss trains on its own samples of the "
        f"prompts of data.train, groups packed globally (packing.mode='global'), one row per "
        f"device (mesh.context=1), without a segment cap and without a preference loss")
  scale = scale_rewards_of(r.loss, r.scale_rewards)
  if r.num_generations == 1 and (r.loss == "rloo" or scale == "group"):
    why = ("rloo's baseline is the other completions of the prompt" if r.loss == "rloo" else
           "a group of one has no reward std (scale_rewards='group')")
    raise RLConfigError(f"rl.num_generations=1 with rl.loss={r.loss!r}: {why}; set "
                        f"--config.rl.num_generations=2 or more")


def scale_rewards_of(loss: str, scale_rewards: str | None) -> str:
  """`rl.scale_rewards`, or the loss's own when None."""
  if scale_rewards is not None:
    return scale_rewards
  return "none" if loss in ("dr_grpo", "rloo") else "group"


def policy_of(config: Any) -> policy_loss.PolicyLoss:
  """The token loss of `rl.loss` with its settings (dapo: `epsilon_high` 0.28 unless set)."""
  r = config.rl
  high = r.epsilon_high
  if high is None and r.loss == "dapo":
    high = DAPO_EPSILON_HIGH
  return policy_loss.PolicyLoss(
      loss_type="grpo" if r.loss == "rloo" else r.loss, epsilon=float(r.epsilon),
      epsilon_high=None if high is None else float(high), beta=float(r.beta),
      max_completion_length=int(r.max_completion_length),
      bias_correction_kl=bool(r.use_bias_correction_kl))


def sampling_of(config: Any) -> Sampling:
  """The draw of `rl.temperature`, `rl.top_k`, `rl.top_p`."""
  r = config.rl
  return Sampling(temperature=float(r.temperature), top_k=int(r.top_k), top_p=float(r.top_p))


def estimator_of(config: Any) -> str:
  """"rloo" (the others' mean as the baseline) for `rl.loss="rloo"`, else "group"."""
  return "rloo" if config.rl.loss == "rloo" else "group"


def dapo_default(config: Any, key: str) -> bool:
  """`rl.drop_equal_groups` or `rl.mask_truncated`, or when None whether the loss is dapo."""
  value = config.rl[key]
  return config.rl.loss == "dapo" if value is None else bool(value)

"""An RL run's settings: the `rl.*` keys with the defaults each loss implies, resolved once.

Defaults by loss, as the papers and TRL's `GRPOConfig` have them: `dr_grpo` divides advantages by
nothing (`scale_rewards="none"`), the others by the group's std; `dapo` clips higher
(`epsilon_high=0.28`), drops groups of equal rewards and masks truncated completions; `rloo` is
GRPO's loss with the leave-one-out advantage, never scaled.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class RLSettings:
  """The resolved `rl.*` keys (configs/packed.py comments each one).

  Attributes:
    policy: the token loss and its normaliser (`segpack.loss.policy.PolicyLoss`).
    estimator: "group" (reward minus the group's mean) or "rloo" (minus the others' mean).
    scale_rewards: "group", "batch" or "none".
    num_generations, prompts_per_step, max_completion_length, inner_steps, lanes: as the keys.
    sampling: the draw (temperature, top-k, top-p).
    drop_equal_groups, mask_truncated: DAPO's dynamic sampling and over-long masking.
    shared_prompt: each group's prompt stored once (False: copied per completion).
    rewards, format_pattern, overlong_buffer: the reward keys.
  """

  policy: policy_loss.PolicyLoss
  estimator: str
  scale_rewards: str
  num_generations: int
  prompts_per_step: int
  max_completion_length: int
  inner_steps: int
  lanes: int
  sampling: Sampling
  drop_equal_groups: bool
  mask_truncated: bool
  shared_prompt: bool
  rewards: str
  format_pattern: str
  overlong_buffer: int

  @classmethod
  def from_config(cls, config: Any) -> "RLSettings":
    r = config.rl
    dapo = r.loss == "dapo"
    high = r.epsilon_high
    if high is None and dapo:
      high = DAPO_EPSILON_HIGH
    policy = policy_loss.PolicyLoss(
        loss_type="grpo" if r.loss == "rloo" else r.loss, epsilon=float(r.epsilon),
        epsilon_high=None if high is None else float(high), beta=float(r.beta),
        max_completion_length=int(r.max_completion_length),
        bias_correction_kl=bool(r.use_bias_correction_kl))
    return cls(
        policy=policy, estimator="rloo" if r.loss == "rloo" else "group",
        scale_rewards=scale_rewards_of(r.loss, r.scale_rewards),
        num_generations=int(r.num_generations), prompts_per_step=int(r.prompts_per_step),
        max_completion_length=int(r.max_completion_length), inner_steps=int(r.inner_steps),
        lanes=int(r.lanes),
        sampling=Sampling(temperature=float(r.temperature), top_k=int(r.top_k),
                          top_p=float(r.top_p)),
        drop_equal_groups=dapo if r.drop_equal_groups is None else bool(r.drop_equal_groups),
        mask_truncated=dapo if r.mask_truncated is None else bool(r.mask_truncated),
        shared_prompt=bool(r.shared_prompt), rewards=str(r.rewards),
        format_pattern=str(r.format_pattern), overlong_buffer=int(r.overlong_buffer))

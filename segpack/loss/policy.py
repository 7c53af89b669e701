"""Policy-gradient losses of the GRPO family on packed rows, one completion per segment.

Every completion token `t` (a slot whose label is not -100) has the policy's log-prob `logp_t`,
the log-prob at sampling time on the same layout `old_t`, its completion's advantage `A_t` and,
with a KL term, the reference's `ref_t`. With `r_t = exp(logp_t - old_t)` (or, at the sequence
level, `exp` of the segment's mean log-ratio: GSPO):

  loss_t = -min(r_t A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) A_t) + beta * kl_t,
  kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                      (k3, always >= 0)

times `r_t` with `bias_correction_kl` (TRL's default: the unbiased reverse-KL gradient of
DeepSeek-V3.2, whose ratio carries a gradient even where it is 1),

and the step's loss is `sum_t w_t loss_t / N` over the global batch (`LOSS_TYPES`, names and
normalisers as TRL's `GRPOConfig.loss_type`):

- `grpo`, `gspo`: `w_t = 1 / |completion of t|`, `N` = completions (mean of token means);
- `bnpo`, `dapo`: `w_t = 1`, `N` = completion tokens (token mean over the batch);
- `dr_grpo`: `w_t = 1`, `N` = completions x `max_completion_length` (a constant per completion).

A completion's tokens are one segment of its row, so every per-completion sum is a segment sum
(`segment_totals`, a running sum along the row): packing changes no number.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from segpack import mesh as mesh_lib
from segpack.errors import UserError
from segpack.loss.labels import IGNORE_INDEX
from segpack.segments import segment_runs

__all__ = ["LOSS_TYPES", "PolicyLoss", "PolicyLossError", "segment_totals"]

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "gspo")


class PolicyLossError(UserError, ValueError):
  """A policy loss's setting is out of range."""


def segment_totals(x_BxS: jax.Array, segment_ids_BxS: jax.Array) -> jax.Array:
  """Every slot's sum of `x` over its run of equal segment ids (a segment of a packed row).

  A row's running sum at the run's last slot minus the one before its first
  (`segpack.segments.segment_runs`): per row, so rows sharded over a mesh stay where they are
  (a row's slots are gathered whole first on a mesh with explicit axes, `segpack.mesh`).
  """
  segment_ids_BxS, x_BxS = mesh_lib.whole_slots(segment_ids_BxS), mesh_lib.whole_slots(x_BxS)
  start_BxS, end_BxS = segment_runs(segment_ids_BxS)
  running_BxS = jnp.cumsum(x_BxS, axis=1)
  at_end = jnp.take_along_axis(running_BxS, end_BxS - 1, axis=1)
  before = jnp.take_along_axis(running_BxS, jnp.maximum(start_BxS - 1, 0), axis=1)
  return at_end - jnp.where(start_BxS > 0, before, 0.0)


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """One loss of `LOSS_TYPES` and its settings (TRL's `GRPOConfig` names).

  Attributes:
    loss_type: one of `LOSS_TYPES`.
    epsilon: the lower clip, `r >= 1 - epsilon`.
    epsilon_high: the upper clip, `r <= 1 + epsilon_high` (None: `epsilon`; DAPO uses 0.28).
    beta: the KL term's weight (0: no reference is needed).
    max_completion_length: `dr_grpo`'s constant normaliser per completion.
    bias_correction_kl: the KL term times the ratio (TRL's `use_bias_correction_kl`).
  """

  loss_type: str = "grpo"
  epsilon: float = 0.2
  epsilon_high: float | None = None
  beta: float = 0.0
  max_completion_length: int = 256
  bias_correction_kl: bool = True

  def __post_init__(self):
    if self.loss_type not in LOSS_TYPES:
      raise PolicyLossError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
    for name in ("epsilon", "epsilon_high", "beta"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float)) and 0 <= value < 1e6):
        raise PolicyLossError(f"{name} must be a number >= 0, got {value!r}")
    if int(self.max_completion_length) < 1:
      raise PolicyLossError(f"max_completion_length must be >= 1, got "
                            f"{self.max_completion_length!r}")

  @property
  def needs_reference(self) -> bool:
    return self.beta != 0

  def normalizer(self, labels_BxS: jax.Array, segment_ids_BxS: jax.Array) -> jax.Array:
    """`N` of the batch (the module docstring)."""
    mask = (labels_BxS != IGNORE_INDEX).astype(jnp.float32)
    if self.loss_type in ("bnpo", "dapo"):
      return jnp.sum(mask)
    completions = jnp.sum(mask / jnp.maximum(segment_totals(mask, segment_ids_BxS), 1.0))
    if self.loss_type == "dr_grpo":
      return completions * float(self.max_completion_length)
    return completions

  def terms(self, logp_BxS: jax.Array, *, old_logp_BxS: jax.Array, advantages_BxS: jax.Array,
            labels_BxS: jax.Array, segment_ids_BxS: jax.Array,
            ref_logp_BxS: jax.Array | None = None) -> dict[str, jax.Array]:
    """Per slot: `loss` (`w_t loss_t`, 0 off the completion tokens), `ratio`, `kl` (k3),
    `clipped_low` / `clipped_high` (the clip bound the gradient stops at), and `mask`."""
    mask = (labels_BxS != IGNORE_INDEX).astype(jnp.float32)
    size = jnp.maximum(segment_totals(mask, segment_ids_BxS), 1.0)
    log_ratio = (logp_BxS - old_logp_BxS) * mask
    if self.loss_type == "gspo":  # the sequence's mean log-ratio, on every one of its tokens
      log_ratio = segment_totals(log_ratio, segment_ids_BxS) / size * mask
    ratio = jnp.exp(log_ratio)
    high = self.epsilon if self.epsilon_high is None else self.epsilon_high
    clipped = jnp.clip(ratio, 1 - self.epsilon, 1 + high)
    loss = -jnp.minimum(ratio * advantages_BxS, clipped * advantages_BxS)
    kl = jnp.zeros_like(loss)
    if self.needs_reference:
      delta = (ref_logp_BxS - logp_BxS) * mask
      kl = jnp.exp(delta) - delta - 1
      loss = loss + self.beta * (kl * ratio if self.bias_correction_kl else kl)
    weight = mask / size if self.loss_type in ("grpo", "gspo") else mask
    return dict(loss=loss * weight, ratio=ratio, kl=kl * mask, mask=mask,
                clipped_low=((ratio < 1 - self.epsilon) & (advantages_BxS < 0)) * mask,
                clipped_high=((ratio > 1 + high) & (advantages_BxS > 0)) * mask)

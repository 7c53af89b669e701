"""Advantages of a round's completions from their rewards, group by group.

`group`: `A_gk = r_gk - mean_k r_gk` (GRPO); `rloo`: `A_gk = r_gk - mean_{j != k} r_gj`
(RLOO's leave-one-out baseline, `G / (G - 1)` times the former). With `scale="group"` the
advantages are divided by the group's reward std (Bessel-corrected) + 1e-4, with `"batch"` by
the round's, with `"none"` by nothing (Dr. GRPO), as TRL's `scale_rewards`.

Example: rewards `[[1, 0, 0, 1]]`: mean 0.5, std 0.577; `group` unscaled gives
`[0.5, -0.5, -0.5, 0.5]`, scaled `[0.866, -0.866, -0.866, 0.866]`; `rloo` gives
`[0.667, -0.667, -0.667, 0.667]`.
"""

from __future__ import annotations

import numpy as np

STD_EPSILON = 1e-4  # TRL's, added to the std before dividing


def _std(x: np.ndarray, axis=None) -> np.ndarray:
  n = x.size if axis is None else x.shape[axis]
  if n < 2:
    return np.zeros(()) if axis is None else np.zeros(x.shape[0])
  return np.std(x, axis=axis, ddof=1)


def advantages(rewards_NxG: np.ndarray, *, estimator: str = "group",
               scale: str = "group") -> np.ndarray:
  """`[N, G]` advantages of `[N, G]` rewards (N groups of G completions; the module docstring)."""
  r = np.asarray(rewards_NxG, np.float64)
  if r.ndim != 2:
    raise ValueError(f"advantages: rewards must be [groups, generations], got shape {r.shape}")
  g = r.shape[1]
  mean = r.mean(axis=1, keepdims=True)
  if estimator == "rloo":
    if g < 2:
      raise ValueError("advantages: rloo needs at least 2 completions per group")
    out = (r - mean) * g / (g - 1)
  elif estimator == "group":
    out = r - mean
  else:
    raise ValueError(f"advantages: estimator must be 'group' or 'rloo', got {estimator!r}")
  if scale == "group":
    out = out / (_std(r, axis=1)[:, None] + STD_EPSILON)
  elif scale == "batch":
    out = out / (_std(r) + STD_EPSILON)
  elif scale != "none":
    raise ValueError(f"advantages: scale must be 'group', 'batch' or 'none', got {scale!r}")
  return out.astype(np.float32)

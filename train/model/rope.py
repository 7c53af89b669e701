"""Rotary position embeddings: frequencies (with Llama 3 / linear rescaling), angles, rotation.

Angles come from `segment_positions`, which restart at 0 in every segment, so a document's
rotations do not depend on where it was packed (or on which decode step wrote its keys).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from configs.architecture import RopeScaling


def rope_inv_freq(*, head_dim: int, theta: float,
                  scaling: RopeScaling | None = None) -> np.ndarray:
  """The `D/2` rotary frequencies (float32), rescaled by `scaling` (see `RopeScaling`).

  Computed in float32 in the order Hugging Face's Llama computes them, so that an imported
  model's angles agree with transformers' to the last bit at thousands of positions.
  """
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)
  if scaling is None or scaling.type is None:
    return inv_freq
  factor = np.float32(scaling.factor)
  if scaling.type == "linear":
    return (inv_freq / factor).astype(np.float32)
  old_len = np.float32(scaling.original_max_position_embeddings)
  low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
  wavelen = np.float32(2 * np.pi) / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq).astype(np.float32)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions_BxS: jax.Array, *, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary angles `[B, S, D/2]` for integer positions (float32)."""
  inv_freq = jnp.asarray(rope_inv_freq(head_dim=head_dim, theta=theta, scaling=scaling))
  return positions_BxS.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x_BxSxHxD: jax.Array, angles_BxSxD2: jax.Array) -> jax.Array:
  """Rotates the two halves of every head vector by the per-position angles (rotate-half form)."""
  x1, x2 = jnp.split(x_BxSxHxD.astype(jnp.float32), 2, axis=-1)
  cos, sin = jnp.cos(angles_BxSxD2)[:, :, None], jnp.sin(angles_BxSxD2)[:, :, None]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxSxHxD.dtype)

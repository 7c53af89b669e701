"""The per-epoch seeded permutation: one definition for rows and for minibatch examples."""

from __future__ import annotations

import numpy as np

__all__ = ["epoch_permutation"]


def epoch_permutation(num_examples: int, *, seed: int, epoch: int) -> np.ndarray:
  """The example order of `epoch`: what unpacked random sampling with `seed` draws.

  It is `np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(num_examples)`
  (the same generator `pack_dataset` uses to shuffle rows), so an unpacked baseline that samples
  minibatches `perm[b*k:(b+1)*k]` sees exactly the minibatches of `pack_minibatches`.
  """
  rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)]))
  return rng.permutation(int(num_examples))

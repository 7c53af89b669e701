"""A mixture epoch drawn as before the draw wrote into compact arrays (commit 8471066): the
baseline of the `mixture` section of `segpack bench packing` (`--mixture-before`) and of
tests/data/test_mixture_draw.py. The pipeline never runs it.

Before, every cycle of a source, whole or not, was a seeded permutation of all its documents
(`default_rng([seed, epoch, source, cycle]).permutation(N)`, int64), the cycles were
concatenated per source and then over the sources, the source index repeated as int64, and
`DocumentSubset` gathered the drawn documents' lengths (int64) through their ids.
"""

from __future__ import annotations

import numpy as np

from segpack.data import subset
from segpack.data.mixture import Draw, MixtureDraws

__all__ = ["draw_before"]


def _source_before(draws: MixtureDraws, i: int, epoch: int) -> tuple[np.ndarray, int, int, int]:
  lengths = draws.lengths[i]
  total = int(draws.total_tokens[i])
  remaining = float(draws.targets[i])
  parts, cycle, tokens, partial = [], 0, 0, 0
  while remaining > 0:
    perm = np.random.default_rng([draws.seed, int(epoch), i, cycle]).permutation(lengths.size)
    if total < remaining:
      parts.append(perm)
      remaining -= total
      tokens += total
      cycle += 1
      continue
    cum = np.cumsum(lengths[perm])
    take = int(np.searchsorted(cum, remaining, side="left")) + 1
    parts.append(perm[:take])
    tokens += int(cum[take - 1])
    partial = take
    break
  fewest = cycle + (1 if partial == lengths.size else 0)
  most = cycle + (1 if 0 < partial else 0)
  ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
  return ids, tokens, fewest, most


def draw_before(draws: MixtureDraws, epoch: int) -> Draw:
  """Mixture epoch `epoch` of `draws`, drawn the old way (module docstring)."""
  per_source = [_source_before(draws, i, epoch) for i in range(len(draws.sources))]
  ids = [d[0] for d in per_source]
  documents = subset.DocumentSubset(
      draws.sources, ids=np.concatenate(ids),
      parent_index=np.repeat(np.arange(len(ids)), [d.size for d in ids]),
      name=f"mixture-epoch-{epoch}")
  return Draw(documents=documents, tokens=np.asarray([d[1] for d in per_source], np.int64),
              targets=draws.targets.copy(),
              min_repeats=np.asarray([d[2] for d in per_source], np.int64),
              max_repeats=np.asarray([d[3] for d in per_source], np.int64))

"""Weighted mixtures of sources whose weights are shares of trained tokens.

`Mixture` names its sources and weights; `pack_dataset(Mixture(...), ...)` draws every mixture
epoch anew (`MixtureDraws.draw`) and packs the drawn documents with one exact global plan. The
one spelling for configs and command lines is `"web=data/web:0.7,code=data/code:0.3"`
(`Mixture.parse`); a plain path is a mixture of one.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from segpack.data import subset
from segpack.data.options import PipelineConfigError
from segpack.data.sources import document_lengths, open_source

__all__ = ["Draw", "Mixture", "MixtureDraws", "MixtureSource"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureSource:
  """One source of a mixture.

  Attributes:
    name: the source's name (in logs, stats and per-source losses).
    source: a dataset directory, a `ShardSource` or any random-access sequence of documents.
    weight: its share of the trained tokens (weights are normalized to sum to 1).
  """

  name: str
  source: Any
  weight: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mixture:
  """Sources mixed by shares of trained tokens, drawn as whole documents every epoch.

  Algorithm of mixture epoch `e` (`T` = `tokens_per_epoch`, default all tokens of all sources;
  `w_i` the normalized weights):

  1. Source `i` must give `T_i = w_i * T` tokens. Its documents are drawn in the order of a
     permutation seeded by `(seed, e, i, 0)`; a source that must give more than it holds goes on
     with a fresh permutation `(seed, e, i, 1)`, and so on, so within one epoch the repetition
     counts of its documents differ by at most one.
  2. Documents are drawn until the source's tokens reach `T_i`: it gives at most one document's
     length more than its target.
  3. One exact global plan (`pack_dataset`'s strategy) packs all the drawn documents of all the
     sources together; the next epoch draws and plans anew.

  Example: sources of 1,000 and 9,000 tokens, weights 0.5 / 0.5, so `T = 10,000`: each must give
  5,000 tokens; the first goes through 5 permutations of its documents, the second draws about
  the first 5/9 of one permutation.

  Attributes:
    sources: the sources, with distinct names.
    tokens_per_epoch: tokens drawn per mixture epoch over all sources; None: the sum of all
      sources' tokens.
    segment_sources: rows also carry `segment_sources` (int32 `[seq_len]`: the index in
      `sources` of each slot's document, -1 on padding), for a loss per source.
  """

  sources: tuple[MixtureSource, ...]
  tokens_per_epoch: int | None = None
  segment_sources: bool = False

  @classmethod
  def parse(cls, spec: str, *, tokens_per_epoch: int | None = None) -> "Mixture":
    """Reads `"name=path:weight,name=path:weight"` (a plain `path`: a mixture of one).

    The name defaults to the path's last component, the weight to 1.

    Raises:
      PipelineConfigError: naming the entry that cannot be read.
    """
    if not isinstance(spec, str) or not spec.strip():
      raise PipelineConfigError(f"mixture: expected 'name=path:weight,...', got {spec!r}")
    entries = []
    for entry in spec.split(","):
      entry = entry.strip()
      name, eq, rest = entry.partition("=")
      if not eq:
        name, rest = "", entry
      path, colon, weight_text = rest.rpartition(":")
      if not colon or os.sep in weight_text or not weight_text:
        path, weight_text = rest, "1"
      try:
        weight = float(weight_text)
      except ValueError as e:
        raise PipelineConfigError(
            f"mixture entry {entry!r}: the weight {weight_text!r} is not a number") from e
      path = path.strip()
      name = name.strip() or os.path.basename(os.path.normpath(path))
      entries.append(MixtureSource(name=name, source=path, weight=weight))
    return cls(sources=tuple(entries), tokens_per_epoch=tokens_per_epoch)


@dataclasses.dataclass(frozen=True)
class Draw:
  """The documents of one mixture epoch.

  Attributes:
    documents: a `DocumentSubset` over the sources: drawn document `j` is document
      `parent_ids[j]` of source `parent_index[j]`.
    tokens: int64 `[num_sources]` tokens drawn from each source.
    targets: float64 `[num_sources]` each source's target `T_i`.
    min_repeats, max_repeats: int64 `[num_sources]` the fewest and most times a document of the
      source was drawn.
  """

  documents: subset.DocumentSubset
  tokens: np.ndarray
  targets: np.ndarray
  min_repeats: np.ndarray
  max_repeats: np.ndarray


class MixtureDraws:
  """A `Mixture` with its sources opened and checked: draws each epoch's documents."""

  def __init__(self, mixture: Mixture, *, seed: int, fn: str = "pack_dataset"):
    if not isinstance(mixture, Mixture) or not mixture.sources:
      raise PipelineConfigError(f"{fn}: a mixture needs at least one source, got {mixture!r}")
    names = [s.name for s in mixture.sources]
    for s in mixture.sources:
      if names.count(s.name) > 1:
        raise PipelineConfigError(f"{fn}: mixture source name {s.name!r} is used twice")
      w = s.weight
      if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
        raise PipelineConfigError(
            f"{fn}: mixture source {s.name!r} needs a positive weight, got {w!r}")
    self.names = names
    self.sources = [self._open(s, fn) for s in mixture.sources]
    self.lengths = [document_lengths(src, fn=fn) for src in self.sources]
    for s, lengths in zip(mixture.sources, self.lengths):
      if lengths.size == 0 or lengths.sum() == 0:
        raise PipelineConfigError(f"{fn}: mixture source {s.name!r} ({s.source!r:.200}) is empty")
    self._check_tokenizers(mixture, fn)
    weights = np.asarray([s.weight for s in mixture.sources], dtype=np.float64)
    self.weights = weights / weights.sum()
    self.total_tokens = np.asarray([int(lengths.sum()) for lengths in self.lengths])
    total = int(self.total_tokens.sum())
    budget = total if mixture.tokens_per_epoch is None else mixture.tokens_per_epoch
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget <= 0:
      raise PipelineConfigError(
          f"{fn}: mixture tokens_per_epoch must be a positive int, got {budget!r}")
    self.tokens_per_epoch = int(budget)
    self.targets = self.weights * self.tokens_per_epoch
    self.seed = int(seed)
    self.segment_sources = bool(mixture.segment_sources)

  @staticmethod
  def _open(entry: MixtureSource, fn: str) -> Any:
    try:
      return open_source(entry.source, fn=fn)
    except (OSError, ValueError) as e:
      raise PipelineConfigError(
          f"{fn}: mixture source {entry.name!r}: {entry.source!r:.200} is not a dataset: {e}"
      ) from e

  def _check_tokenizers(self, mixture: Mixture, fn: str) -> None:
    prints = [getattr(src, "tokenizer_fingerprint", None) for src in self.sources]
    for entry, fingerprint in zip(mixture.sources[1:], prints[1:]):
      if fingerprint != prints[0]:
        first = mixture.sources[0]
        raise PipelineConfigError(
            f"{fn}: mixture sources {first.name!r} (tokenizer {prints[0]}) and {entry.name!r} "
            f"(tokenizer {fingerprint}) were tokenized differently; all sources need one "
            f"tokenizer")

  def _draw_source(self, i: int, epoch: int) -> tuple[np.ndarray, int, int, int]:
    """Source `i`'s draw in `epoch` (steps 1 and 2): `(ids in draw order, tokens, fewest and
    most repeats of a document)`. Whole permutations are taken without reading their lengths;
    only the last, partial one is summed."""
    lengths = self.lengths[i]
    total = int(self.total_tokens[i])
    remaining = float(self.targets[i])
    parts, cycle, tokens = [], 0, 0
    while remaining > 0:
      perm = np.random.default_rng([self.seed, int(epoch), i, cycle]).permutation(lengths.size)
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
    else:
      partial = 0
    full = cycle  # whole permutations: every document that many times, plus the partial one
    fewest = full + (1 if partial == lengths.size else 0)
    most = full + (1 if 0 < partial else 0)
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return ids, tokens, fewest, most

  def draw(self, epoch: int) -> Draw:
    """The documents of mixture epoch `epoch` (a pure function of the seed and the epoch)."""
    draws = [self._draw_source(i, epoch) for i in range(len(self.sources))]
    ids = [d[0] for d in draws]
    documents = subset.DocumentSubset(
        self.sources, ids=np.concatenate(ids),
        parent_index=np.repeat(np.arange(len(ids)), [d.size for d in ids]),
        name=f"mixture-epoch-{epoch}")
    return Draw(documents=documents, tokens=np.asarray([d[1] for d in draws], np.int64),
                targets=self.targets.copy(),
                min_repeats=np.asarray([d[2] for d in draws], np.int64),
                max_repeats=np.asarray([d[3] for d in draws], np.int64))

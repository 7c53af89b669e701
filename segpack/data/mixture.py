"""Weighted mixtures of sources whose weights are shares of trained tokens.

`Mixture` names its sources and weights; `pack_dataset(Mixture(...), ...)` draws every mixture
epoch anew (`MixtureDraws.draw`) and packs the drawn documents with one exact global plan. The
one spelling for configs and command lines is `"web=data/web:0.7,code=data/code:0.3"`, read by
`parse_data` (one dataset or a mixture: the trainer's `data.train` and `segpack stats --data`
both use it) and `Mixture.parse` (one dataset is a mixture of one).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import numpy as np

from segpack.data import mixture_draw, subset
from segpack.data.options import PipelineConfigError
from segpack.data.sources import document_lengths, open_source

__all__ = ["Draw", "Mixture", "MixtureDraws", "MixtureSource", "parse_data"]


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

  1. Source `i` must give `T_i = w_i * T` tokens. While it must give more than it holds, it
     gives every document once (a whole cycle) and goes on with the rest, so within one epoch
     the repetition counts of its documents differ by at most one.
  2. Its last cycle (after `F` whole ones) draws documents in the order of the permutation
     `default_rng([seed, e, i, F]).permutation(N_i)` until the source's tokens reach `T_i`: it
     gives at most one document's length more than its target. Whole cycle `c` gives its
     documents in an order of its own, from that permutation and `(seed, e, i, c)`
     (`segpack.data.mixture_draw`).
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
    """Reads `"name=path:weight,name=path:weight"` by the rules of `parse_data`; one dataset
    (`data/mine`) is a mixture of one, named after the path's last component.

    Raises:
      PipelineConfigError: naming the entry that cannot be read.
    """
    mixture = parse_data(spec, tokens_per_epoch=tokens_per_epoch)
    if mixture is not None:
      return mixture
    path = spec.strip()
    return cls(sources=(MixtureSource(name=_default_name(path), source=path, weight=1.0),),
               tokens_per_epoch=tokens_per_epoch)

  def shares(self) -> str:
    """The target token share of every source, for logs: `"web 70.0%, code 30.0%"`, or
    `"equal token shares"` when all weights are equal (as when none was given)."""
    weights = [float(s.weight) for s in self.sources]
    if len(set(weights)) == 1:
      return "equal token shares"
    total = math.fsum(weights)
    return ", ".join(f"{s.name} {100 * w / total:.1f}%" for s, w in zip(self.sources, weights))


def _default_name(path: str) -> str:
  """A source's name when the entry gives none: the path's last component."""
  return os.path.basename(os.path.normpath(path))


def _number(text: str) -> float | None:
  """`text` as a float, or None when it does not spell a number."""
  try:
    return float(text)
  except ValueError:
    return None


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One entry of a data argument as read: `name` ("" when not given), `path`, `weight` (the
  text after the last ':', None when not given)."""

  text: str
  name: str
  path: str
  weight: str | None


def _by_syntax(text: str) -> _Entry:
  """An entry read by its spelling alone: a name before the first '=' (when it holds no '/'),
  a weight after the last ':' (when it is not empty and holds no '/')."""
  name, eq, rest = text.partition("=")
  if not eq or "/" in name or os.sep in name:
    name, rest = "", text
  head, colon, tail = rest.rpartition(":")
  if colon and head.strip() and tail.strip() and "/" not in tail and os.sep not in tail:
    return _Entry(text, name.strip(), head.strip(), tail.strip())
  return _Entry(text, name.strip(), rest.strip(), None)


def _plain(entry: _Entry) -> bool:
  """Whether the entry is a bare path (no name, no weight)."""
  return not entry.name and entry.weight is None


def _valid(entry: _Entry, exists: Callable[[str], bool]) -> bool:
  """Whether `entry` names an existing path with no weight or a number for one."""
  return bool(entry.path) and exists(entry.path) and (
      entry.weight is None or _number(entry.weight) is not None)


def _readings(text: str) -> list[_Entry]:
  """Every way to read one entry: the whole text as a path, `name=` + a path, a path + `:weight`
  (with or without the name)."""
  syntax = _by_syntax(text)
  out = [_Entry(text, "", text, None)]
  if syntax.name:
    out.append(_Entry(text, syntax.name, text.partition("=")[2].strip(), None))
  if syntax.weight is not None:
    head = text.rpartition(":")[0].strip()
    out.append(_Entry(text, "", head, syntax.weight))
  out.append(syntax)
  return list(dict.fromkeys(out))


def _as_path(path: str) -> str:
  """A spelling of the directory `path` that no rule reads as a name or a weight."""
  return (path if os.path.isabs(path) else os.path.join(".", path)).rstrip("/") + "/"


def _spelled(entries: list[_Entry]) -> str:
  """The entries written so that each reads one way only."""
  return ",".join((f"{e.name}=" if e.name else "") + _as_path(e.path)
                  + (f":{e.weight}" if e.weight is not None else "") for e in entries)


def _said(e: _Entry) -> str:
  """One reading in words: `the dataset 'D/ds' with weight 2`."""
  return (f"the dataset {e.path!r}" + (f" named {e.name!r}" if e.name else "")
          + (f" with weight {e.weight}" if e.weight is not None else ""))


def _read_entry(text: str, exists: Callable[[str], bool]) -> _Entry:
  """One entry: the reading whose path exists; none: the spelling's; several: refused."""
  valid = [e for e in _readings(text) if _valid(e, exists)]
  if len(valid) > 1:
    raise PipelineConfigError(
        f"{text!r} reads {len(valid)} ways: " + "; or ".join(_said(e) for e in valid)
        + "; write " + " or ".join(repr(_spelled([e])) for e in valid) + " to say which")
  return valid[0] if valid else _by_syntax(text)


def _read_entries(text: str, exists: Callable[[str], bool]) -> list[_Entry]:
  """The entries of `text`: an existing path is a path; a spelling that also reads as other
  existing datasets is refused naming both readings."""
  parts = [part.strip() for part in text.split(",")]
  if len(parts) == 1:
    return [_read_entry(text, exists)]
  if exists(text):
    syntax = [_by_syntax(part) for part in parts]
    if all(_valid(e, exists) for e in syntax):
      raise PipelineConfigError(
          f"{text!r} reads two ways: the dataset {text!r}, or the mixture {_spelled(syntax)!r}; "
          f"write {_as_path(text)!r} for the first or {_spelled(syntax)!r} for the second")
    return [_Entry(text, "", text, None)]
  return [_read_entry(part, exists) for part in parts]


def _weights(entries: list[_Entry]) -> list[float]:
  """Every entry's weight: all given or none (then equal); each finite and > 0, the sum too."""
  given = [e for e in entries if e.weight is not None]
  if given and len(given) < len(entries):
    bare = next(e for e in entries if e.weight is None)
    raise PipelineConfigError(
        f"mixture entry {bare.text!r} has no weight but {given[0].text!r} has one; give every "
        f"entry a weight, or none for equal token shares")
  weights = []
  for e in entries:
    if e.weight is None:
      weights.append(1.0)
      continue
    w = _number(e.weight)
    if w is None:
      raise PipelineConfigError(
          f"mixture entry {e.text!r}: the weight {e.weight!r} is not a number, and "
          f"{e.text.partition('=')[2] if e.name else e.text!r} is no existing path")
    if not (math.isfinite(w) and w > 0):
      raise PipelineConfigError(
          f"mixture entry {e.text!r}: mixture source {e.name or _default_name(e.path)!r} needs a "
          f"positive weight, got {w!r} (a finite number > 0)")
    weights.append(w)
  if not math.isfinite(sum(weights)):
    top = entries[max(range(len(weights)), key=weights.__getitem__)]
    raise PipelineConfigError(
        f"mixture entry {top.text!r}: the weights sum to infinity; weights are relative, so "
        f"scale them down (0.7 and 0.3 mix like 7 and 3)")
  return weights


def parse_data(spec: str, *, tokens_per_epoch: int | None = None,
               exists: Callable[[str], bool] = os.path.exists) -> Mixture | None:
  """The one rule for a data argument (`data.train`, `segpack stats --data`): one dataset
  (None) or a `Mixture`.

  Rules:
    1. An existing path is a path, whatever it holds (`D/run:v2`, `D/lr=3e-4`, `D/a,b`).
    2. Otherwise `spec` is entries `name=path:weight` separated by ','; the name (before the
       first '=', holding no '/') defaults to the path's last component, the weight is the text
       after the last ':' (holding no '/'). Within an entry, rule 1 holds again.
    3. A spelling that reads both ways (`D/ds:2` when both `D/ds:2` and `D/ds` exist) is refused,
       naming both readings and how to write each (`./D/ds:2/`, `./D/ds/:2`).
    4. Every entry has a weight or none has (equal token shares); weights are finite and > 0,
       and so is their sum.
    5. One entry without a name and a weight is one dataset (None); anything else a mixture.

  Args:
    spec: the argument's text.
    tokens_per_epoch: the mixture's `tokens_per_epoch`.
    exists: whether a path exists (a test may stand in for the file system).

  Raises:
    PipelineConfigError: one line naming the entry (and both readings of an ambiguous one).
  """
  if not isinstance(spec, str) or not spec.strip():
    raise PipelineConfigError(f"mixture: expected 'name=path:weight,...' or a dataset path, "
                              f"got {spec!r}")
  entries = _read_entries(spec.strip(), exists)
  if len(entries) == 1 and _plain(entries[0]):
    return None
  for e in entries:
    if not e.path:
      raise PipelineConfigError(f"mixture entry {e.text!r} names no path")
  weights = _weights(entries)
  return Mixture(sources=tuple(
      MixtureSource(name=e.name or _default_name(e.path), source=e.path, weight=w)
      for e, w in zip(entries, weights)), tokens_per_epoch=tokens_per_epoch)


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


# Host bytes per drawn document of one mixture epoch, draw and plan together (docs/benchmarks.md,
# "Mixtures": the draw keeps 9 and peaks at 10, the plan adds 12.4 at its peak), with room.
BYTES_PER_DRAWN_DOCUMENT = 32


def _physical_memory() -> int:
  """This machine's physical memory in bytes (0 when the system does not say)."""
  try:
    return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return 0


def _check_draw_memory(tokens_per_epoch: int, lengths: list[np.ndarray], fn: str) -> None:
  """Refuses a `tokens_per_epoch` whose draw could not fit in memory (it would run for minutes
  and end in a MemoryError): the documents it draws are about `tokens_per_epoch` over the mean
  document length, each costing `BYTES_PER_DRAWN_DOCUMENT` bytes."""
  total_docs = sum(int(x.size) for x in lengths)
  mean = sum(int(x.sum()) for x in lengths) / max(total_docs, 1)
  documents = tokens_per_epoch / max(mean, 1.0)
  memory = _physical_memory()
  if memory and documents * BYTES_PER_DRAWN_DOCUMENT > memory:
    raise PipelineConfigError(
        f"{fn}: tokens_per_epoch={tokens_per_epoch:,} draws about {documents:,.0f} documents "
        f"(mean length {mean:,.0f} tokens), about {documents * BYTES_PER_DRAWN_DOCUMENT / 2**30:,.0f}"
        f" GiB to draw and plan, more than this machine's {memory / 2**30:,.0f} GiB; lower it")


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
    if not math.isfinite(sum(weights.tolist())):
      raise PipelineConfigError(
          f"{fn}: mixture weights {weights.tolist()} sum to infinity; weights are relative, so "
          f"scale them down (0.7 and 0.3 mix like 7 and 3)")
    self.weights = weights / weights.sum()
    self.total_tokens = np.asarray([int(lengths.sum()) for lengths in self.lengths])
    total = int(self.total_tokens.sum())
    budget = total if mixture.tokens_per_epoch is None else mixture.tokens_per_epoch
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget <= 0:
      raise PipelineConfigError(
          f"{fn}: mixture tokens_per_epoch must be a positive int, got {budget!r}")
    self.tokens_per_epoch = int(budget)
    _check_draw_memory(self.tokens_per_epoch, self.lengths, fn)
    self.targets = self.weights * self.tokens_per_epoch
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
      raise PipelineConfigError(f"{fn}: the mixture's seed must be an int >= 0, got {seed!r}")
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

  def draw(self, epoch: int) -> Draw:
    """The documents of mixture epoch `epoch` (a pure function of the seed and the epoch),
    drawn source by source (`segpack.data.mixture_draw`) into arrays made for the whole epoch:
    ids and lengths int32 where they fit, the source index in the smallest unsigned type."""
    bounds = [(mixture_draw.cycles(int(total), float(target))[0] + 1) * lengths.size
              for total, target, lengths in zip(self.total_tokens, self.targets, self.lengths)]
    room = sum(bounds)  # at most this many: entries past the draw are never written (or paid)
    ids = np.empty(room, mixture_draw.index_dtype(max(x.size for x in self.lengths)))
    big = max(int(x.max()) for x in self.lengths) >= 2**31
    lengths = np.empty(room, np.int64 if big else np.int32)
    which = np.empty(room, np.min_scalar_type(len(self.sources) - 1))
    pos, drawn = 0, []
    for i, source_lengths in enumerate(self.lengths):
      count, tokens, fewest, most = mixture_draw.draw_source(
          source_lengths, entropy=[self.seed, int(epoch), i], target=float(self.targets[i]),
          ids_out=ids[pos:], lengths_out=lengths[pos:])
      which[pos:pos + count] = i
      pos += count
      drawn.append((tokens, fewest, most))
    documents = subset.DocumentSubset(
        self.sources, ids=ids[:pos], parent_index=which[:pos], lengths=lengths[:pos],
        name=f"mixture-epoch-{epoch}")
    return Draw(documents=documents, tokens=np.asarray([d[0] for d in drawn], np.int64),
                targets=self.targets.copy(),
                min_repeats=np.asarray([d[1] for d in drawn], np.int64),
                max_repeats=np.asarray([d[2] for d in drawn], np.int64))

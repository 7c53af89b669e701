"""The plan cache: a plan is computed once per (data, parameters) and memory-mapped after."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from typing import Any, Callable

import numpy as np

from segpack.packing import cap as cap_lib
from segpack.packing import planner as _planner
from segpack.packing.chunking import (BLOCK, DEFAULT_LONG_DOCS, LongDocs, PackingArgumentError,
                                      check_args, check_lengths)
from segpack.packing.plan_format import FORMAT_VERSION, Plan, PlanError, check_plan

_log = logging.getLogger(__name__)


def lengths_fingerprint(lengths: np.ndarray) -> str:
  """A content hash of a lengths array, for sources without a fingerprint of their own."""
  digest = hashlib.sha256()
  for a in range(0, len(lengths), BLOCK):  # the bytes of the int64 array, one block at a time
    digest.update(np.ascontiguousarray(lengths[a:a + BLOCK], dtype=np.int64).tobytes())
  return "lengths-sha256:" + digest.hexdigest()


def plan_key(key: str, seq_len: int, *, strategy: str = "ffd",
             long_docs: LongDocs = DEFAULT_LONG_DOCS, extra_tokens: int = 0, batch_size: int = 8,
             pad_multiple: int = 128) -> str:
  """The cache directory name for a source `key` and every parameter that changes a plan."""
  check_args(seq_len, long_docs=long_docs, extra_tokens=extra_tokens)
  params = {"key": str(key), "seq_len": int(seq_len), "strategy": strategy,
            "long_docs": long_docs.mode, "min_len": int(long_docs.min_len),
            "overlap": int(long_docs.overlap),
            "extra_tokens": int(extra_tokens), "format_version": FORMAT_VERSION}
  if strategy == "sorted_pad":
    params.update(batch_size=int(batch_size), pad_multiple=int(pad_multiple))
  blob = json.dumps(params, sort_keys=True).encode()
  return f"{strategy}-{int(seq_len)}-" + hashlib.sha256(blob).hexdigest()[:24]


def load_or_plan(lengths: Any, seq_len: int, *, cache_dir: str | os.PathLike | None,
                 key: str | None = None, strategy: str = "ffd",
                 long_docs: LongDocs = DEFAULT_LONG_DOCS, extra_tokens: int = 0,
                 batch_size: int = 8, pad_multiple: int = 128,
                 max_segments_per_row: int | None = None) -> Plan:
  """Loads the cached plan for these documents and parameters, or plans and caches it.

  The plan lives in `cache_dir/<plan_key(...)>/` (the pipeline uses `<dataset dir>/plans`), is
  written atomically and is memory-mapped when found. A plan that fails to load or does not match
  the documents is recomputed and replaced. When `cache_dir` cannot be written (a read-only data
  set), the plan is returned without being cached and a warning is logged.

  With `max_segments_per_row = N` the plan is capped (`segpack.packing.cap.cap_segments_per_row`)
  and the capped plan is cached too, beside the uncapped one, as `<plan key>-maxseg<N>`; a later
  call loads it without planning or capping.

  Args:
    lengths: 1-D integer document lengths.
    seq_len: slots per row.
    cache_dir: directory of cached plans; None disables the cache.
    key: a fingerprint of the documents (`ShardSource.fingerprint`); None hashes `lengths`.
    strategy, long_docs, extra_tokens, batch_size, pad_multiple: as in `segpack.packing.plan`.
    max_segments_per_row: None, or the most pieces (segments) a row may hold, >= 1.

  Returns:
    The plan, memory-mapped when it came from (or went to) the cache.
  """
  kwargs = dict(strategy=strategy, long_docs=long_docs, extra_tokens=extra_tokens,
                batch_size=batch_size, pad_multiple=pad_multiple)
  _planner.check_strategy(strategy)
  lengths = check_lengths(lengths)
  cap = max_segments_per_row
  if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer))
                          or cap < 1):
    raise PackingArgumentError(
        f"max_segments_per_row must be None or an int >= 1, got max_segments_per_row={cap!r}")

  def make_plan() -> Plan:
    return _planner.plan(lengths, seq_len, **kwargs)

  if cache_dir is None:
    return make_plan() if cap is None else cap_lib.cap_segments_per_row(make_plan(), int(cap))
  if key is None:
    key = lengths_fingerprint(lengths)
  path = os.path.join(os.fspath(cache_dir), plan_key(key, seq_len, **kwargs))
  if cap is None:
    return _load_or_make(path, lengths, seq_len, make_plan)
  return _load_or_make(
      f"{path}-maxseg{int(cap)}", lengths, seq_len,
      lambda: cap_lib.cap_segments_per_row(
          _load_or_make(path, lengths, seq_len, make_plan), int(cap)))


def _load_or_make(path: str, lengths: np.ndarray, seq_len: int,
                  make: Callable[[], Plan]) -> Plan:
  """The plan cached at `path` when it is intact and matches (the documents of `lengths`,
  `seq_len`), else `make()` saved there and memory-mapped back (or returned uncached when `path`
  cannot be written).

  A cached plan is used only when its files match the checksums saved beside them
  (`Plan.load(verify=True)`) and it passes `plan_format.check_plan` for these documents; any
  other plan is recomputed with a warning naming the directory.
  """
  existing = os.path.isdir(path)
  if existing:
    try:
      cached = Plan.load(path, mmap=True)
      if cached.stats.get("documents") != lengths.size or cached.seq_len != seq_len:
        raise PlanError(f"made for {cached.stats.get('documents')} documents and seq_len "
                        f"{cached.seq_len}, not {lengths.size} and {seq_len}")
      check_plan(cached, lengths, path)
      return cached
    except PlanError as e:
      warnings.warn(f"plan cache {path} is damaged or stale ({e}); replanning", stacklevel=3)
  fresh = make()
  try:
    fresh.save(path, overwrite=existing)  # a concurrent writer's identical plan may win
  except OSError as e:
    _log.warning("cannot write the plan cache %s (%s); using the plan uncached", path, e)
    return fresh
  return Plan.load(path, mmap=True)

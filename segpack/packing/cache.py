"""The plan cache: a plan is computed once per (data, parameters) and memory-mapped after."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import numpy as np

from segpack.packing.chunking import check_lengths
from segpack.packing.plan import FORMAT_VERSION, Plan, PlanError
from segpack.packing import planner as _planner

_log = logging.getLogger(__name__)


def lengths_fingerprint(lengths: np.ndarray) -> str:
  """A content hash of a lengths array, for sources without a fingerprint of their own."""
  arr = np.ascontiguousarray(lengths, dtype=np.int64)
  return "lengths-sha256:" + hashlib.sha256(arr.tobytes()).hexdigest()


def plan_key(key: str, seq_len: int, *, strategy: str = "ffd", long_docs: str = "split",
             min_len: int = 0, overlap: int = 0, extra_tokens: int = 0, batch_size: int = 8,
             pad_multiple: int = 128) -> str:
  """The cache directory name for a source `key` and every parameter that changes a plan."""
  params = {"key": str(key), "seq_len": int(seq_len), "strategy": strategy,
            "long_docs": long_docs, "min_len": int(min_len), "overlap": int(overlap),
            "extra_tokens": int(extra_tokens), "format_version": FORMAT_VERSION}
  if strategy == "sorted_pad":
    params.update(batch_size=int(batch_size), pad_multiple=int(pad_multiple))
  blob = json.dumps(params, sort_keys=True).encode()
  return f"{strategy}-{int(seq_len)}-" + hashlib.sha256(blob).hexdigest()[:24]


def load_or_plan(lengths: Any, seq_len: int, *, cache_dir: str | os.PathLike | None,
                 key: str | None = None, strategy: str = "ffd", long_docs: str = "split",
                 min_len: int = 0, overlap: int = 0, extra_tokens: int = 0,
                 batch_size: int = 8, pad_multiple: int = 128) -> Plan:
  """Loads the cached plan for these documents and parameters, or plans and caches it.

  The plan lives in `cache_dir/<plan_key(...)>/` (the pipeline uses `<dataset dir>/plans`), is
  written atomically and is memory-mapped when found. A plan that fails to load or does not match
  the documents is recomputed and replaced. When `cache_dir` cannot be written (a read-only data
  set), the plan is returned without being cached and a warning is logged.

  Args:
    lengths: 1-D integer document lengths.
    seq_len: slots per row.
    cache_dir: directory of cached plans; None disables the cache.
    key: a fingerprint of the documents (`ShardSource.fingerprint`); None hashes `lengths`.
    strategy, long_docs, min_len, overlap, extra_tokens, batch_size, pad_multiple: as in
      `segpack.packing.plan`.

  Returns:
    The plan, memory-mapped when it came from (or went to) the cache.
  """
  kwargs = dict(strategy=strategy, long_docs=long_docs, min_len=min_len, overlap=overlap,
                extra_tokens=extra_tokens, batch_size=batch_size, pad_multiple=pad_multiple)
  _planner.check_strategy(strategy)
  lengths = check_lengths(lengths)
  if cache_dir is None:
    return _planner.plan(lengths, seq_len, **kwargs)
  if key is None:
    key = lengths_fingerprint(lengths)
  path = os.path.join(os.fspath(cache_dir), plan_key(key, seq_len, **kwargs))
  existing = os.path.isdir(path)
  if existing:
    try:
      cached = Plan.load(path, mmap=True)
      if cached.stats.get("documents") == len(lengths) and cached.seq_len == seq_len:
        return cached
      _log.warning("plan cache %s does not match the documents; replanning", path)
    except PlanError as e:
      _log.warning("plan cache %s is unreadable (%s); replanning", path, e)
  fresh = _planner.plan(lengths, seq_len, **kwargs)
  try:
    fresh.save(path, overwrite=existing)  # a concurrent writer's identical plan may win
  except OSError as e:
    _log.warning("cannot write the plan cache %s (%s); using the plan uncached", path, e)
    return fresh
  return Plan.load(path, mmap=True)

"""`python -m segpack.bench.verify --gb 1`: what verifying shards on open costs.

Writes a synthetic dataset of `--gb` GB of random uint16 tokens (vocabulary 32000, documents of
1 to 4000 tokens, shards of 2**27 tokens) with `ShardWriter` into a temporary directory under
`--dir` (default `/tmp`), then times, each with an empty verification cache of its own:

- `never`: `ShardSource(path, verify="never")`, the structural checks alone;
- `first`: the first `ShardSource(path)` on the machine (every file hashed);
- `first_scan`: the same for a manifest without `max_token` (hashed and scanned for ids);
- `cached`: a later `ShardSource(path)` (nothing hashed), the median of `--repeats`.

The files were just written, so they are read from the page cache: a cold disk reads slower.
The dataset is deleted afterwards. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from segpack import errors
from segpack.shards import ShardSource, ShardWriter

VOCAB = 32000


def write_dataset(path: Path, gb: float, seed: int = 0) -> int:
  """Writes about `gb` * 1e9 bytes of uint16 tokens to `path`; returns the token count."""
  rng = np.random.default_rng(seed)
  want = int(gb * 1e9) // 2
  written = 0
  with ShardWriter(path, vocab_size=VOCAB, tokenizer_fingerprint="sha256:bench") as w:
    while written < want:
      block = rng.integers(0, VOCAB, size=1 << 22, dtype=np.uint16)
      cuts = np.cumsum(rng.integers(1, 4001, size=4096))
      cuts = cuts[cuts < block.size]
      for doc in np.split(block, cuts):
        if written >= want:
          break
        w.write(doc)
        written += doc.size
  return written


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def _open_with_cache(path: Path, cache: Path, **kw) -> float:
  """Seconds of one `ShardSource(path, **kw)` with `$SEGPACK_CACHE` = `cache`."""
  old = os.environ.get("SEGPACK_CACHE")
  os.environ["SEGPACK_CACHE"] = str(cache)
  try:
    return _timed(lambda: ShardSource(path, **kw))
  finally:
    if old is None:
      os.environ.pop("SEGPACK_CACHE")
    else:
      os.environ["SEGPACK_CACHE"] = old


def measure(root: Path, gb: float, repeats: int) -> dict:
  """Writes the dataset under `root` and returns the timings (see the module docstring)."""
  path = root / "data"
  t_write = _timed(lambda: write_dataset(path, gb))
  nbytes = sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".tokens", ".offsets"))
  out = {"gb": gb, "bytes": nbytes, "shards": len(ShardSource(path, verify="never").manifest[
      "shards"]), "write_s": round(t_write, 2)}
  out["never_ms"] = round(1e3 * _open_with_cache(path, root / "c0", verify="never"), 2)
  first = _open_with_cache(path, root / "c1")
  out["first_s"] = round(first, 3)
  out["first_mb_per_s"] = round(nbytes / first / 1e6, 1)
  cached = [_open_with_cache(path, root / "c1") for _ in range(repeats)]
  out["cached_ms"] = round(1e3 * statistics.median(cached), 2)
  manifest_path = path / "manifest.json"
  manifest = json.loads(manifest_path.read_text("utf-8"))
  older = json.loads(json.dumps(manifest))
  for shard in older["shards"]:
    del shard["max_token"]
  manifest_path.write_text(json.dumps(older), "utf-8")
  first_scan = _open_with_cache(path, root / "c2")
  out["first_scan_s"] = round(first_scan, 3)
  out["first_scan_mb_per_s"] = round(nbytes / first_scan / 1e6, 1)
  return out


@errors.command("python -m segpack.bench.verify")
def main(argv: list[str] | None = None) -> None:
  """Command-line entry point (see the module docstring)."""
  parser = argparse.ArgumentParser(prog="python -m segpack.bench.verify", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gb", type=errors.at_least(0.001, float),
                      default=1.0, help="dataset size in GB (1e9 bytes)")
  parser.add_argument("--dir", type=errors.directory,
                      default="/tmp", help="where the temporary dataset is written")
  parser.add_argument("--repeats", type=errors.at_least(1),
                      default=5, help="cached opens timed (median)")
  args = parser.parse_args(argv)
  root = Path(tempfile.mkdtemp(prefix="segpack-bench-verify-", dir=args.dir))
  try:
    print(json.dumps(measure(root, args.gb, args.repeats), indent=1))
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()

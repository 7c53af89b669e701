"""`python -m segpack.bench.s3_staging --mb 256`: what staging a dataset from S3 costs.

Starts a local S3 server (moto, `pip install 'moto[server]' boto3`) on 127.0.0.1 with dummy
credentials, uploads a synthetic dataset of `--mb` MB of random uint16 tokens
(`segpack.bench.verify.write_dataset`, shards of `--shard-tokens` tokens) and times:

- `boto3_get`: every file read with boto3's `get_object`, nothing written (the server's and the
  loopback's own speed, for comparison);
- `stage`: `segpack.shards.staging.stage_dataset` into an empty cache (download through Beam's
  S3 client, SHA-256 of every file, fsync, rename, manifest), the median of `--repeats`, after
  one untimed stage that builds the S3 client;
- `again`: a second `stage_dataset` of the same URL (nothing missing: a no-op).

Loopback to a server in the same process: it measures segpack's and Beam's overhead and the
server's, not a network. Prints a table, or one JSON object with `--json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from segpack.bench import verify as bench_verify
from segpack.shards import staging

BUCKET = "segpack-bench"


def _server():
  """A moto S3 server on a free loopback port, the environment pointed at it; (server, URL)."""
  try:
    import boto3  # optional: the benchmark's own uploads (segpack[test])
    from moto.server import ThreadedMotoServer  # optional: moto[server] (segpack[test])
    import portpicker  # optional: a free port (segpack[test])
  except ImportError as e:
    raise SystemExit(f"python -m segpack.bench.s3_staging needs moto[server], boto3 and "
                     f"portpicker: pip install -e '.[test]' ({e})") from e
  logging.getLogger("werkzeug").setLevel(logging.ERROR)
  port = portpicker.pick_unused_port()
  server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
  server.start()
  endpoint = f"http://127.0.0.1:{port}"
  os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint,
                     "AWS_EC2_METADATA_DISABLED": "true"})
  client = boto3.client("s3", endpoint_url=endpoint)
  client.create_bucket(Bucket=BUCKET)
  return server, client


def measure(root: Path, *, mb: float, repeats: int) -> dict[str, Any]:
  """Uploads a `mb` MB dataset under `root`'s server and times the stages (see the docstring)."""
  os.environ["SEGPACK_CACHE"] = str(root / "segpack-cache")  # The verified-files record.
  server, client = _server()
  try:
    local = root / "dataset"
    bench_verify.write_dataset(local, mb / 1000)
    paths = sorted(p for p in local.iterdir() if p.is_file())
    for p in paths:
      client.upload_file(str(p), BUCKET, f"ds/{p.name}")
    total = sum(p.stat().st_size for p in paths if p.name != "manifest.json")
    url = f"s3://{BUCKET}/ds"
    start = time.perf_counter()
    for p in paths:
      client.get_object(Bucket=BUCKET, Key=f"ds/{p.name}")["Body"].read()
    boto3_get = time.perf_counter() - start
    staging.stage_dataset(url=url, cache_dir=root / "warm-up", progress=False)  # Clients built.
    shutil.rmtree(root / "warm-up")
    times, again = [], []
    for r in range(repeats):
      cache = root / f"cache{r}"
      times.append(staging.stage_dataset(url=url, cache_dir=cache, progress=False).seconds)
      again.append(staging.stage_dataset(url=url, cache_dir=cache, progress=False).seconds)
      shutil.rmtree(cache)
  finally:
    server.stop()
  stage = statistics.median(times)
  return {"mb": total / 1e6, "files": len(paths), "repeats": repeats,
          "boto3_get_s": boto3_get, "boto3_get_mb_s": total / 1e6 / boto3_get,
          "stage_s": stage, "stage_mb_s": total / 1e6 / stage,
          "again_s": statistics.median(again), "cpus": os.cpu_count(),
          "where": "loopback, moto server in this process"}


def _table(r: dict[str, Any]) -> str:
  rows = [("dataset", f"{r['mb']:.0f} MB in {r['files']} files"),
          ("boto3 get_object, all files", f"{r['boto3_get_s']:.2f} s ({r['boto3_get_mb_s']:.0f} "
                                          f"MB/s)"),
          (f"stage_dataset, empty cache (median of {r['repeats']})",
           f"{r['stage_s']:.2f} s ({r['stage_mb_s']:.0f} MB/s)"),
          ("stage_dataset again (no-op)", f"{r['again_s'] * 1e3:.0f} ms"),
          ("where", f"{r['where']}, {r['cpus']} CPUs")]
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> None:
  """Command-line entry point (see the module docstring)."""
  parser = argparse.ArgumentParser(prog="python -m segpack.bench.s3_staging", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mb", type=float, default=256.0, help="dataset size in MB (1e6 bytes)")
  parser.add_argument("--repeats", type=int, default=3, help="cold stages timed (median)")
  parser.add_argument("--dir", default="/tmp", help="where the temporary files are written")
  parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
  args = parser.parse_args(argv)
  if args.mb <= 0 or args.repeats < 1:
    parser.error(f"--mb must be > 0 and --repeats >= 1, got {args.mb} and {args.repeats}")
  root = Path(tempfile.mkdtemp(prefix="segpack-bench-s3-staging-", dir=args.dir))
  try:
    result = measure(root, mb=args.mb, repeats=args.repeats)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(json.dumps(result, indent=1) if args.json else _table(result))


if __name__ == "__main__":
  main()

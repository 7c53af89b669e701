"""Staging: a shard dataset at a URL (`gs://`, `s3://`, `hdfs://`) copied into a local cache.

`ShardSource` memory-maps local files only; given a URL it stages the dataset first
(`stage_dataset`) and opens the copy. The copy lives in `$SEGPACK_CACHE/staged/` (default
`~/.cache/segpack/staged/`), one directory per URL, and every process of the host reuses it.

Algorithm:
  1. Check that the remote manifest exists (and that URLs can be read here: Apache Beam
     installed) before creating anything locally, so a refusal leaves nothing in the cache; a
     later failure removes the URL's directory when this call created it and it is still empty.
     Under an exclusive lock on the URL's directory (`segpack.files.file_lock`, as the corpus
     cache), read the remote manifest. When the local copy holds the same manifest and every
     listed file with its size, staging is a no-op.
  2. Otherwise remove the local manifest first (the copy never looks complete while it is
     changed), then, for every file the manifest lists: keep a local file whose SHA-256 is the
     manifest's; else download it into `NAME.part`, continuing a part an interrupted run left
     (from its length), hash it and rename it into place. A file whose checksum is not the
     manifest's is downloaded once more from its start; a second mismatch is refused with a
     `ShardFormatError` naming the remote file.
  3. Write the manifest last (atomically), remove files of older versions, and record the
     verified checksums in `segpack.shards.verified`, so `ShardSource` does not hash them again.

Progress: a tqdm bar of bytes and rate when tqdm is importable, else a log line per file.
Reading URLs goes through Beam's filesystems (`segpack.remote_files`, extra `segpack[beam]`); an
S3 endpoint, credentials and region come from boto3's environment (`AWS_ENDPOINT_URL_S3`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from segpack import errors
from segpack import files
from segpack import remote_files
from segpack.shards import verified
from segpack.shards.format import MANIFEST_NAME, OWNED_FILE, ShardFormatError

try:
  import tqdm
except ImportError:  # A dependency of segpack; without it, log lines instead of a bar.
  tqdm = None

__all__ = ["StagedDataset", "stage_dataset", "staged_dir"]

_BLOCK = 1 << 23
# The environment variable bounding the first request to a dataset's URL (seconds).
TIMEOUT_ENV = "SEGPACK_REMOTE_TIMEOUT"
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StagedDataset:
  """The result of `stage_dataset`.

  Attributes:
    path: the local copy (open it with `ShardSource`).
    url: the dataset's URL.
    total_bytes: the bytes of the files the manifest lists.
    downloaded_bytes: bytes downloaded by this call (0: nothing was missing).
    kept_files: listed files that were already there and intact.
    seconds: wall time of the call.
  """

  path: Path
  url: str
  total_bytes: int
  downloaded_bytes: int
  kept_files: int
  seconds: float


def staged_dir(*, url: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
  """The local directory of `url`'s copy: `CACHE/staged/<hash of the URL>-<last component>`."""
  root = Path(cache_dir).expanduser() if cache_dir is not None else verified.cache_file().parent
  name = url.rstrip("/").rsplit("/", 1)[-1] or "dataset"
  return root / "staged" / f"{hashlib.sha256(url.encode('utf-8')).hexdigest()[:16]}-{name}"


def _listed_files(url: str, manifest: Any) -> list[tuple[str, str]]:
  """(file name, sha256) of every file the manifest lists; its names must be the format's."""
  where = remote_files.join(url, MANIFEST_NAME)
  if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
    raise ShardFormatError(f"{where}: corrupt manifest, no list of shards")
  kinds = ("tokens", "offsets") + (("mask",) if manifest.get("loss_mask") else ())
  out = []
  for shard in manifest["shards"]:
    for kind in kinds:
      try:
        name, digest = shard[kind], shard["sha256"][kind]
      except (KeyError, TypeError):
        raise ShardFormatError(f"{where}: shard entry {shard!r} has no {kind} file and sha256"
                               ) from None
      if not isinstance(name, str) or not OWNED_FILE.match(name) or name.endswith(".tmp"):
        raise ShardFormatError(f"{where}: shard file name {name!r} is not a shard file name")
      out.append((name, str(digest)))
  return out


def _download(src: str, dest: Path, *, start: int, bar) -> int:
  """Appends `src`'s bytes from offset `start` to `dest`; returns the bytes downloaded."""
  done = 0
  with remote_files.open_read(src) as f, open(dest, "ab" if start else "wb") as out:
    if start:
      f.seek(start)
    while block := f.read(_BLOCK):
      out.write(block)
      done += len(block)
      if bar is not None:
        bar.update(len(block))
    out.flush()
    os.fsync(out.fileno())
  return done


def _fetch(url: str, folder: Path, name: str, digest: str, bar) -> int:
  """Brings one listed file into `folder` (resuming its `.part`); returns bytes downloaded."""
  src, dest = remote_files.join(url, name), folder / name
  part = folder / f"{name}.part"
  downloaded = 0
  for attempt in range(2):
    start = part.stat().st_size if attempt == 0 and part.exists() else 0
    downloaded += _download(src, part, start=start, bar=bar)
    got = files.sha256_file(part)
    if got == digest:
      os.replace(part, dest)
      return downloaded
    part.unlink()
  raise ShardFormatError(f"{src}: checksum mismatch: sha256 {got} but the manifest says "
                         f"{digest}; the remote file is corrupt (nothing of it was kept)")


def _complete(folder: Path, manifest_bytes: bytes, sizes: dict[str, int]) -> bool:
  """The local copy holds this manifest and every listed file with its remote size."""
  try:
    if (folder / MANIFEST_NAME).read_bytes() != manifest_bytes:
      return False
    return all((folder / n).stat().st_size == s for n, s in sizes.items())
  except OSError:
    return False


def reach_timeout() -> float:
  """Seconds the first request to a dataset's URL may take: `$SEGPACK_REMOTE_TIMEOUT`, else 60."""
  value = os.environ.get(TIMEOUT_ENV, "60")
  try:
    seconds = float(value)
  except ValueError:
    seconds = float("nan")
  if not seconds > 0 or seconds == float("inf"):
    raise ShardFormatError(f"${TIMEOUT_ENV}={value!r} must be a number of seconds > 0")
  return seconds


def _probe(where: str, timeout: float) -> bool:
  """`remote_files.exists(where)` within `timeout` seconds, in a daemon thread: an endpoint that
  refuses connections or credentials that are missing make the client retry for minutes, so
  the wait is bounded here and what the client raised comes back as it is."""
  box: dict[str, Any] = {}
  # Beam's retry decorator logs every retry with its traceback; the wait is bounded here and
  # its outcome said in one line, so those lines would only bury it (they may go on after the
  # timeout, in the abandoned thread, until the process ends).
  logging.getLogger("apache_beam.utils.retry").setLevel(logging.ERROR)

  def ask():
    try:
      box["found"] = remote_files.exists(where)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the caller)
      box["error"] = e

  worker = threading.Thread(target=ask, name="segpack-reach", daemon=True)
  worker.start()
  worker.join(timeout)
  if worker.is_alive():
    raise TimeoutError(f"no answer within {timeout:g} s (the endpoint is unreachable or the "
                       f"client keeps retrying; ${TIMEOUT_ENV} sets the wait)")
  if "error" in box:
    raise box["error"]
  return box["found"]


def _require_manifest(url: str, where: str) -> None:
  """Raises a one-line ShardFormatError naming `url` when its manifest `where` is not there,
  when the URL cannot be reached (no answer within `reach_timeout()`, refused, no credentials:
  the cause in a few words), or when URLs cannot be read here (Apache Beam, or boto3 for
  `s3://`, not installed)."""
  try:
    found = _probe(where, reach_timeout())
  except ImportError as e:
    cause = e.__cause__ or e
    raise ShardFormatError(f"{url}: a dataset at a URL is staged through Apache Beam's "
                           f"filesystems, which are not installed ({cause}); pip install "
                           f"'segpack[beam]'") from e
  except Exception as e:  # pylint: disable=broad-except  (any client error: the URL, the cause)
    cause = errors.one_line(e)[:300]
    raise ShardFormatError(f"{url}: cannot be reached: {type(e).__name__}: {cause}") from e
  if not found:
    raise ShardFormatError(f"{where}: missing manifest, so {url} is not a finished dataset "
                           f"(rerun `segpack tokenize` to complete it); nothing was staged")


def stage_dataset(*, url: str, cache_dir: str | os.PathLike[str] | None = None,
                  progress: bool = True) -> StagedDataset:
  """Copies the dataset at `url` into the local cache (see the module docstring).

  Args:
    url: the dataset directory's URL (`gs://B/P`, `s3://B/P`, `hdfs://...`), or a local path.
    cache_dir: the cache root; default `$SEGPACK_CACHE`, else `~/.cache/segpack`.
    progress: show the download's bytes and rate.

  Returns:
    The local copy and what this call did.

  Raises:
    ShardFormatError: Apache Beam not installed (a URL is read through its filesystems), no
      manifest at `url` (both before anything is created in the cache), a listed file missing,
      or a file whose checksum is not the manifest's (named by its URL).
  """
  start = time.perf_counter()
  url = url.rstrip("/")
  where = remote_files.join(url, MANIFEST_NAME)
  _require_manifest(url, where)  # Before anything is created here: a refusal leaves nothing.
  folder = staged_dir(url=url, cache_dir=cache_dir)
  created = not folder.exists()
  folder.mkdir(parents=True, exist_ok=True)
  try:
    with files.file_lock(folder.with_name(folder.name + ".lock")):
      manifest_bytes = remote_files.read_bytes(where)
      try:
        listed = _listed_files(url, json.loads(manifest_bytes))
      except ValueError as e:
        raise ShardFormatError(f"{where}: corrupt manifest ({e})") from e
      remote = {os.path.basename(p.rstrip("/")): s
                for p, s in remote_files.list_files(url).items()}
      missing = [n for n, _ in listed if n not in remote]
      if missing:
        raise ShardFormatError(f"{remote_files.join(url, missing[0])}: shard file listed in the "
                               f"manifest is missing ({len(missing)} missing)")
      sizes = {n: remote[n] for n, _ in listed}
      total = sum(sizes.values())
      if _complete(folder, manifest_bytes, sizes):
        return StagedDataset(folder, url, total, 0, len(listed), time.perf_counter() - start)
      (folder / MANIFEST_NAME).unlink(missing_ok=True)
      downloaded, kept, records = _stage_files(url, folder, listed, sizes, progress)
      files.atomic_write_bytes(folder / MANIFEST_NAME, manifest_bytes)
      names = {n for n, _ in listed}
      for path in folder.iterdir():  # Files of an older version of the dataset.
        if path.name not in names and path.name != MANIFEST_NAME:
          path.unlink(missing_ok=True)
      verified.VerifiedCache().record(records)
  except BaseException:
    if created:  # Only when empty: a partial download stays for the next call to resume.
      with contextlib.suppress(OSError):
        folder.rmdir()
    raise
  return StagedDataset(folder, url, total, downloaded, kept, time.perf_counter() - start)


def _stage_files(url: str, folder: Path, listed: list[tuple[str, str]], sizes: dict[str, int],
                 progress: bool) -> tuple[int, int, dict[str, Any]]:
  """Keeps the intact local files, downloads the others; (bytes downloaded, files kept, the
  verified-cache entries of every file)."""
  need, kept, records = [], 0, {}
  for name, digest in listed:
    path = folder / name
    if path.exists() and path.stat().st_size == sizes[name] and files.sha256_file(path) == digest:
      kept += 1
    else:
      need.append((name, digest))
  todo = sum(sizes[n] for n, _ in need) - sum(
      (folder / f"{n}.part").stat().st_size for n, _ in need if (folder / f"{n}.part").exists())
  bar = (tqdm.tqdm(total=max(todo, 0), unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"staging {url}", disable=not progress) if tqdm is not None else None)
  downloaded = 0
  try:
    for i, (name, digest) in enumerate(need):
      tick = time.perf_counter()
      got = _fetch(url, folder, name, digest, bar)
      downloaded += got
      if bar is None and progress:
        _log.warning("staging %s: %s (%d/%d), %.1f MB at %.1f MB/s", url, name, i + 1, len(need),
                     got / 1e6, got / 1e6 / max(time.perf_counter() - tick, 1e-9))
  finally:
    if bar is not None:
      bar.close()
  for name, digest in listed:
    path = folder / name
    records[verified.entry_name(path)] = {"sha256": digest, "key": verified.file_key(path)}
  return downloaded, kept, records

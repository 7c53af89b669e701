"""Files named by a local path or a URL (`gs://`, `s3://`, `hdfs://`, ...), one set of calls.

A URL is read, listed, written and deleted through Apache Beam's
`apache_beam.io.filesystems.FileSystems` (the extra `segpack[beam]`; `s3://` also needs boto3),
so every scheme Beam knows works, with the options Beam takes for it (`--s3_endpoint_url`,
`--s3_region_name`, `--hdfs_host`, ...: `configure`). A local path is handled with the operating
system's calls, and its writes stay atomic (`segpack.files.atomic_write_bytes`).

An object store has no rename: a URL's file appears whole when its upload is closed, under its
final name, and is replaced whole by a later upload of the same name. Writers that must never
show a half-finished dataset write a file that vouches for the others last (the manifest).

`s3://` goes through Beam's S3 client (`apache_beam.io.aws.s3io.S3IO`, the object behind its
S3 filesystem) built once per set of options: Beam's filesystem builds a new boto3 client for
every call, a fraction of a second each, which a dataset of thousands of files cannot afford.

Without `configure`, the first URL call configures Beam's filesystems with no flags: S3
credentials, region and endpoint then come from boto3's own environment (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL_S3`), and Google Cloud's from
its default credentials. Inside a Beam pipeline the pipeline's options are used as they are.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from segpack import files

__all__ = ["configure", "delete", "exists", "file_info", "is_url", "join", "list_files", "local_copy",
           "open_read", "read_bytes", "sha256", "write_bytes"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_BLOCK = 1 << 22
# The S3 client of the filesystems' current options: (options, S3IO), filled on first use.
_S3: list[Any] = []


def is_url(path: str | os.PathLike[str]) -> bool:
  """True when `path` is a URL (`scheme://...`), which Beam's filesystems open."""
  return bool(_URL.match(os.fspath(path)))


def _filesystems():
  """Beam's `FileSystems`, configured once with no flags unless a pipeline or `configure` did."""
  try:
    from apache_beam.io.filesystems import FileSystems  # optional: segpack[beam], URLs only
  except ImportError as e:
    raise ImportError(f"URLs (gs://, s3://, hdfs://) are opened through Apache Beam's "
                      f"filesystems: pip install 'segpack[beam]' ({e})") from e
  if getattr(FileSystems, "_pipeline_options", None) is None:
    configure(flags=())
  return FileSystems


def _s3(path: str):
  """Beam's S3IO for `path` (an `s3://` URL) under the current options, else None."""
  if not path.startswith("s3://"):
    return None
  options = getattr(_filesystems(), "_pipeline_options", None)
  if not _S3 or _S3[0] is not options:
    from apache_beam.io.aws import s3io  # optional: segpack[beam] with boto3, s3:// only
    _S3[:] = [options, s3io.S3IO(options=options)]
  return _S3[1]


def configure(*, flags: Sequence[str] | str) -> None:
  """Sets the options of Beam's filesystems: Beam flags such as `--s3_endpoint_url=URL`, as a
  list or as one command-line string."""
  from apache_beam.io.filesystems import FileSystems  # optional: segpack[beam], URLs only
  from apache_beam.options.pipeline_options import PipelineOptions  # optional: segpack[beam]
  flags = shlex.split(flags) if isinstance(flags, str) else list(flags)
  FileSystems.set_options(PipelineOptions(flags=flags))


def join(base: str, *names: str) -> str:
  """`base/name/...`, for a URL or a local path."""
  if is_url(base):
    return "/".join([base.rstrip("/"), *names])
  return os.path.join(base, *names)


def list_files(prefix: str, *, recursive: bool = False) -> dict[str, int]:
  """Full path -> size in bytes of the files under the directory `prefix` (with `recursive`,
  in its subdirectories too), sorted by path; {} when there is none."""
  if _s3(prefix) is not None:
    base = prefix.rstrip("/") + "/"
    out = {p: int(size) for p, size in _s3(prefix).list_files(base)
           if recursive or "/" not in p[len(base):]}
  elif is_url(prefix):
    pattern = join(prefix, "**" if recursive else "*")
    found = _filesystems().match([pattern])[0].metadata_list
    out = {m.path: int(m.size_in_bytes) for m in found}
  else:
    root = Path(prefix)
    if not root.is_dir():
      return {}
    paths = root.rglob("*") if recursive else root.iterdir()
    out = {str(p): p.stat().st_size for p in paths if p.is_file()}
  return dict(sorted(out.items()))


def exists(path: str) -> bool:
  """True when the file exists."""
  if _s3(path) is not None:
    return _s3(path).exists(path)
  return _filesystems().exists(path) if is_url(path) else os.path.exists(path)


def open_read(path: str) -> BinaryIO:
  """The file's bytes as a binary stream (seekable), never decompressed."""
  if _s3(path) is not None:
    return _s3(path).open(path, "rb")
  if is_url(path):
    return _filesystems().open(path, compression_type="uncompressed")
  return open(path, "rb")


def read_bytes(path: str) -> bytes:
  """The whole file."""
  with open_read(path) as f:
    return f.read()


def write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to `path`: a local path atomically (a temporary file and a rename), a URL by
  one upload that appears under its name only when complete."""
  if not is_url(path):
    files.atomic_write_bytes(Path(path), data)
    return
  if _s3(path) is not None:
    stream = _s3(path).open(path, "wb")
  else:
    stream = _filesystems().create(path, mime_type="application/octet-stream",
                                   compression_type="uncompressed")
  with stream as f:
    f.write(data)


def delete(paths: Sequence[str]) -> None:
  """Deletes the files; one already gone is no error."""
  urls = [p for p in paths if is_url(p)]
  for p in paths:
    if not is_url(p):
      Path(p).unlink(missing_ok=True)
  for url in [u for u in urls if _s3(u) is not None]:
    _s3(url).delete(url)  # Gone already: no error.
  urls = [u for u in urls if _s3(u) is None]
  if urls:
    fs = _filesystems()
    present = [u for u in urls if fs.exists(u)]
    if present:
      fs.delete(present)


def sha256(path: str) -> str:
  """The hex SHA-256 of the file, read in blocks."""
  if not is_url(path):
    return files.sha256_file(path)
  digest = hashlib.sha256()
  with open_read(path) as f:
    while block := f.read(_BLOCK):
      digest.update(block)
  return digest.hexdigest()


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[Path]:
  """A local path of the file: itself, or a URL's download into a temporary directory (same
  file name, so its suffix still tells the format) that is removed afterwards."""
  if not is_url(path):
    yield Path(path)
    return
  with tempfile.TemporaryDirectory(prefix="segpack-") as tmp:
    local = Path(tmp) / path.rstrip("/").rsplit("/", 1)[-1]
    with open_read(path) as src, open(local, "wb") as dst:
      while block := src.read(_BLOCK):
        dst.write(block)
    yield local


def file_info(path: str) -> dict[str, Any]:
  """`{"path", "size", "mtime"}` of one file (a URL: its metadata from one listing)."""
  if not is_url(path):
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime": st.st_mtime_ns}
  if _s3(path) is not None:
    return {"path": path, "size": int(_s3(path).size(path)),
            "mtime": _s3(path).last_updated(path)}
  found = _filesystems().match([path])[0].metadata_list
  if not found:
    raise FileNotFoundError(f"{path}: no such file")
  m = found[0]
  return {"path": path, "size": int(m.size_in_bytes),
          "mtime": getattr(m, "last_updated_in_seconds", None)}

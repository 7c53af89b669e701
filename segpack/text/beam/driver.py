"""The driver's side of `segpack tokenize --runner beam` (`segpack.text.beam.pipeline`).

Before the pipeline runs, the driver looks at the output directory: a finished dataset with the
same resume key whose files check out is the answer (`finished_manifest`, which names missing or
damaged files and refuses them unless `--overwrite` asks for a rebuild); otherwise the directory
is cleared of every file the shard format owns except the units an interrupted run finished and
whose files still match their checksums (`clear_output`, `kept_units`). After the run it raises the bad inputs the
pipeline reported (`raise_input_errors`) and reads its counters (`read_counter`). Also here: the
names the pipeline's steps and the driver share (`unit_names`, `ERRORS_FILE`,
`METRICS_NAMESPACE`), and Apache Beam's import, options and local runner (`local_runner`), which
the extra `segpack[beam]` provides.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from segpack import errors
from segpack import remote_files
from segpack import shards as shards_lib
from segpack.shards.format import (MAX_MANIFEST_BYTES, OFFSET_DTYPE, OWNED_FILE, load_manifest,
                                   read_manifest)
from segpack.text import encode
from segpack.text.inputs import InputFormatError

__all__ = ["ERRORS_FILE", "METRICS_NAMESPACE", "clear_output", "finished_manifest", "import_beam",
           "kept_units", "local_runner", "pipeline_options", "quiet_step_errors",
           "raise_input_errors", "read_counter", "unit_names"]

METRICS_NAMESPACE = "segpack"  # The namespace of the pipeline's Beam counters.
ERRORS_FILE = "beam-errors.json"  # Where the final step leaves the bad inputs for the driver.
_DONE = re.compile(r"^shard-\d{5,}-\d{5,}\.done\.json$")


def unit_names(index: int, block: int, shard: int | None = None) -> str:
  """The file stem of shard `shard` of unit (index, block), or of the unit's done-record."""
  stem = f"shard-{index:05d}-{block:05d}"
  return stem if shard is None else f"{stem}-{shard:05d}"


def _name(path: str) -> str:
  """The file name of a listed path (local or URL)."""
  return path.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]


def kept_units(output: str, resume_key: str, dtype: np.dtype) -> list[dict[str, Any]]:
  """Done-records of an interrupted run with the same key whose files match their sizes and
  checksums (`output`: a local directory or a URL)."""
  kept = []
  listed = {_name(p): size for p, size in remote_files.list_files(output).items()}
  for name in sorted(n for n in listed if _DONE.match(n)):
    try:
      record = json.loads(remote_files.read_bytes(remote_files.join(output, name)))
      ok = (record.get("resume_key") == resume_key and record.get("dtype") == dtype.name
            and name == f"{unit_names(*record['unit'])}.done.json"
            and all(s[kind] in listed and remote_files.sha256(
                remote_files.join(output, s[kind])) == s["sha256"][kind]
                    for s in record["shards"] for kind in ("tokens", "offsets")))
    except (OSError, ValueError, KeyError, TypeError):
      ok = False
    if ok:
      kept.append(record)
  return kept


def finished_manifest(output: str, resume_key: str, overwrite: bool) -> dict[str, Any] | None:
  """The checked manifest of a finished dataset with the same key at `output`, to be kept as is
  (None: there is none, or `overwrite` asks for a rebuild).

  A local `output` gets the local runner's check (`encode.finished_dataset`: every file's size,
  the offsets, the checksums); at a URL the manifest is read (at most `MAX_MANIFEST_BYTES`) and
  checked (`load_manifest`, `metadata_sha256` included), and every listed file's size is checked
  in one listing (hashing them would download the whole dataset; staging hashes every file).

  Raises:
    InputFormatError: the manifest is unreadable, holds another key, or files are missing or
      resized (naming them); each says that `--overwrite` rebuilds the dataset.
  """
  if not remote_files.is_url(output):
    return encode.finished_dataset(Path(output), resume_key, overwrite=overwrite)
  manifest_path = remote_files.join(output, shards_lib.MANIFEST_NAME)
  if overwrite or not remote_files.exists(manifest_path):
    return None
  where = f"output={output!r} (--output)"
  with tempfile.TemporaryDirectory(prefix="segpack-manifest-") as tmp:
    local = Path(tmp) / shards_lib.MANIFEST_NAME  # Errors name the URL, not this copy.
    try:
      old = _copy_manifest(manifest_path, local)
    except shards_lib.ShardFormatError as e:
      raise InputFormatError(f"{where}: the manifest is unreadable: "
                             f"{str(e).replace(str(local), manifest_path)}; pass overwrite=True "
                             f"(--overwrite) to rebuild the dataset") from e
    if not isinstance(old, dict) or old.get("resume_key") != resume_key:
      raise InputFormatError(f"{where} already holds a dataset made from other inputs or "
                             f"settings; pass overwrite=True (--overwrite) to replace it")
    try:
      manifest = load_manifest(Path(tmp))
    except shards_lib.ShardFormatError as e:
      raise InputFormatError(f"{where} holds a finished dataset that is damaged: "
                             f"{str(e).replace(str(local), manifest_path)}; pass overwrite=True "
                             f"(--overwrite) to rebuild it") from e
  itemsize = np.dtype(manifest["dtype"]).itemsize
  listed = {_name(p): size for p, size in remote_files.list_files(output).items()}
  bad = []
  for shard in manifest["shards"]:
    want = {shard["tokens"]: shard["num_tokens"] * itemsize,
            shard["offsets"]: (shard["num_documents"] + 1) * OFFSET_DTYPE.itemsize}
    for name, size in want.items():
      if name not in listed:
        bad.append(f"{name} (missing)")
      elif listed[name] != size:
        bad.append(f"{name} ({listed[name]} bytes, expected {size})")
  if bad:
    raise InputFormatError(f"{where} holds a finished dataset with missing or damaged files: "
                           f"{', '.join(bad)}; pass overwrite=True (--overwrite) to rebuild it")
  return manifest


def _copy_manifest(url: str, local: Path) -> Any:
  """Copies at most `MAX_MANIFEST_BYTES` + 1 bytes of the manifest at `url` to `local` and
  returns them parsed (`read_manifest`: over the bound, not UTF-8 or not JSON is refused)."""
  with remote_files.open_read(url) as f:
    local.write_bytes(f.read(MAX_MANIFEST_BYTES + 1))
  return read_manifest(local)


def clear_output(output: str, resume_key: str, dtype: np.dtype) -> list[dict[str, Any]]:
  """Removes the manifest first (the directory never looks finished), then every file the format
  owns except the kept units' (`kept_units`); returns the kept done-records."""
  if not remote_files.is_url(output):
    Path(output).mkdir(parents=True, exist_ok=True)
  remote_files.delete([remote_files.join(output, shards_lib.MANIFEST_NAME)])
  kept = kept_units(output, resume_key, dtype)
  keep = {f"{unit_names(*r['unit'])}.done.json" for r in kept}
  keep.update(s[k] for r in kept for s in r["shards"] for k in ("tokens", "offsets"))
  remote_files.delete([p for p in remote_files.list_files(output)
                       if OWNED_FILE.match(_name(p)) and _name(p) not in keep])
  return kept


def pipeline_options(beam_options: str):
  """Beam's PipelineOptions of the `--beam-options` string, also set as the options of Beam's
  filesystems (so `--s3_endpoint_url` and the like reach the driver's own reads of URLs). The SDK
  workers log warnings and errors only (Beam's INFO lines per worker would bury the summary)
  unless the string says otherwise (`--default_sdk_harness_log_level=INFO`)."""
  from apache_beam.io.filesystems import FileSystems  # optional: segpack[beam]
  from apache_beam.options.pipeline_options import PipelineOptions  # optional: segpack[beam]
  try:
    flags = shlex.split(beam_options)
  except ValueError as e:
    raise InputFormatError(f"beam_options={beam_options!r} (--beam-options): {e}") from e
  options = PipelineOptions(flags=["--default_sdk_harness_log_level=WARNING", *flags])
  _check_runner(options, beam_options)
  FileSystems.set_options(options)  # The driver's own reads and writes of URLs use them too.
  return options


def _check_runner(options: Any, beam_options: str) -> None:
  """An unknown `--runner=` in `--beam-options` is one line before anything is written (Beam
  itself refuses it only when the pipeline is built, with its traceback)."""
  from apache_beam.options.pipeline_options import StandardOptions  # optional: segpack[beam]
  from apache_beam.runners import runner as runner_lib  # optional: segpack[beam]
  name = options.view_as(StandardOptions).runner
  if name is None:
    return
  try:
    runner_lib.create_runner(name)
  except (ValueError, ImportError) as e:
    raise InputFormatError(f"beam_options={beam_options!r} (--beam-options): runner {name!r} is "
                           f"not one Beam can run here ({errors.one_line(e)[:300]})") from e


_DIRECT = (None, "DirectRunner", "SwitchingDirectRunner")


def local_runner(options: Any):
  """The runner for `options` that names no runner, or Beam's DirectRunner: Beam's FnApiRunner,
  built as the DirectRunner builds it for a batch pipeline (the options reach the SDK workers, so
  `--direct_num_workers`, `--direct_running_mode` and the S3 flags work in each worker). None for
  any other runner, which Beam then creates from the options.

  Recent Beam releases' DirectRunner (2.77's; not 2.60's) first tries its Prism runner, which
  downloads a Go binary from GitHub at run time (or builds one with `go install`) and, offline,
  fails and leaves temporary directories behind before falling back to the FnApiRunner. segpack
  downloads nothing while it runs, so it goes to the FnApiRunner directly; `--runner=PrismRunner`
  still asks for Prism.
  """
  from apache_beam.options.pipeline_options import StandardOptions  # optional: segpack[beam]
  if options.view_as(StandardOptions).runner not in _DIRECT:
    return None
  from apache_beam.portability.api import beam_provision_api_pb2  # optional: segpack[beam]
  from apache_beam.runners.portability.fn_api_runner import fn_runner  # optional: segpack[beam]
  from apache_beam.runners.portability import portable_runner  # optional: segpack[beam]
  encoded = portable_runner.JobServiceHandle.encode_pipeline_options(options.get_all_options())
  return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(
      beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)))


def import_beam():
  """Apache Beam, imported on first use; its import-time warnings about the Google Cloud
  clients it finds missing (BigQuery, irrelevant here) are not shown."""
  root = logging.getLogger()
  level = root.level
  root.setLevel(logging.ERROR)
  try:
    import apache_beam  # optional: the extra segpack[beam], needed only for --runner beam
  except ImportError as e:
    raise InputFormatError(f"runner='beam' (--runner) needs Apache Beam: pip install "
                           f"'segpack[beam]' ({e})") from e
  finally:
    root.setLevel(level)
  return apache_beam


def raise_input_errors(output: str) -> None:
  """Raises the first bad input (in input order) that the pipeline reported, if any."""
  path = remote_files.join(output, ERRORS_FILE)
  if not remote_files.exists(path):
    return
  bad = json.loads(remote_files.read_bytes(path))
  remote_files.delete([path])
  raise InputFormatError(bad[0][1] if len(bad) == 1 else
                         f"{bad[0][1]} (and {len(bad) - 1} more bad inputs)")


@contextlib.contextmanager
def quiet_step_errors():
  """Beam logs a failing step's traceback before it re-raises the step's exception (which names
  the step); the exception reaches the caller, so the CLI prints one line, not a traceback."""
  logger = logging.getLogger("apache_beam.runners.common")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    logger.setLevel(level)


def read_counter(result, name: str) -> int:
  """A `segpack` counter of a finished pipeline (0 when the runner reports no metrics)."""
  from apache_beam.metrics.metric import MetricsFilter  # optional: segpack[beam]
  try:
    found = result.metrics().query(
        MetricsFilter().with_namespace(METRICS_NAMESPACE).with_name(name))["counters"]
  except (NotImplementedError, KeyError):
    return 0
  return int(sum(c.committed or 0 for c in found))

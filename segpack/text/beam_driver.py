"""The driver's side of `segpack tokenize --runner beam` (`segpack.text.beam_pipeline`).

Before the pipeline runs, the driver looks at the output directory: a finished dataset with the
same resume key is the answer (`finished_manifest`); otherwise the directory is cleared of every
file the shard format owns except the units an interrupted run finished and whose files still
match their checksums (`clear_output`, `kept_units`). After the run it raises the bad inputs the
pipeline reported (`raise_input_errors`) and reads its counters (`read_counter`). Also here: the
names the pipeline's steps and the driver share (`unit_names`, `ERRORS_FILE`,
`METRICS_NAMESPACE`), and Apache Beam's import and options, which the extra `segpack[beam]`
provides.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from segpack import files
from segpack import shards as shards_lib
from segpack.shards.format import OWNED_FILE
from segpack.text.inputs import InputFormatError

__all__ = ["ERRORS_FILE", "METRICS_NAMESPACE", "clear_output", "finished_manifest", "import_beam",
           "kept_units", "pipeline_options", "quiet_step_errors", "raise_input_errors",
           "read_counter", "unit_names"]

METRICS_NAMESPACE = "segpack"  # The namespace of the pipeline's Beam counters.
ERRORS_FILE = "beam-errors.json"  # Where the final step leaves the bad inputs for the driver.


def unit_names(index: int, block: int, shard: int | None = None) -> str:
  """The file stem of shard `shard` of unit (index, block), or of the unit's done-record."""
  stem = f"shard-{index:05d}-{block:05d}"
  return stem if shard is None else f"{stem}-{shard:05d}"


def kept_units(output: Path, resume_key: str, dtype: np.dtype) -> list[dict[str, Any]]:
  """Done-records of an interrupted run with the same key whose files match their checksums."""
  kept = []
  for done in sorted(output.glob("shard-*-*.done.json")):
    try:
      record = json.loads(done.read_text("utf-8"))
      ok = (record.get("resume_key") == resume_key and record.get("dtype") == dtype.name
            and done.name == f"{unit_names(*record['unit'])}.done.json"
            and all(files.sha256_file(output / s[kind]) == s["sha256"][kind]
                    for s in record["shards"] for kind in ("tokens", "offsets")))
    except (OSError, ValueError, KeyError, TypeError):
      ok = False
    if ok:
      kept.append(record)
  return kept


def finished_manifest(output: Path, resume_key: str, overwrite: bool) -> dict[str, Any] | None:
  """The manifest of a finished dataset with the same key at `output` (None: there is none);
  raises when another dataset is there and `overwrite` is not set."""
  manifest_path = output / shards_lib.MANIFEST_NAME
  if not manifest_path.exists():
    return None
  try:
    old = json.loads(manifest_path.read_text("utf-8"))
  except ValueError:
    old = {}
  if isinstance(old, dict) and old.get("resume_key") == resume_key:
    return old
  if not overwrite:
    raise InputFormatError(f"--output {str(output)!r} already holds a dataset made from other "
                           f"inputs or settings; pass --overwrite to replace it")
  return None


def clear_output(output: Path, resume_key: str, dtype: np.dtype) -> list[dict[str, Any]]:
  """Removes the manifest first (the directory never looks finished), then every file the format
  owns except the kept units' (`kept_units`); returns the kept done-records."""
  output.mkdir(parents=True, exist_ok=True)
  (output / shards_lib.MANIFEST_NAME).unlink(missing_ok=True)
  kept = kept_units(output, resume_key, dtype)
  keep = {f"{unit_names(*r['unit'])}.done.json" for r in kept}
  keep.update(s[k] for r in kept for s in r["shards"] for k in ("tokens", "offsets"))
  for path in output.iterdir():
    if OWNED_FILE.match(path.name) and path.name not in keep:
      path.unlink()
  return kept


def pipeline_options(beam_options: str):
  """Beam's PipelineOptions of the `--beam-options` string; the SDK workers log warnings and
  errors only (Beam's INFO lines per worker would bury the summary) unless the string says
  otherwise (`--default_sdk_harness_log_level=INFO`)."""
  from apache_beam.options.pipeline_options import PipelineOptions  # optional: segpack[beam]
  try:
    flags = shlex.split(beam_options)
  except ValueError as e:
    raise InputFormatError(f"--beam-options {beam_options!r}: {e}") from e
  return PipelineOptions(flags=["--default_sdk_harness_log_level=WARNING", *flags])


def import_beam():
  """Apache Beam, imported on first use; its import-time warnings about the Google Cloud
  clients it finds missing (BigQuery, irrelevant here) are not shown."""
  root = logging.getLogger()
  level = root.level
  root.setLevel(logging.ERROR)
  try:
    import apache_beam  # optional: the extra segpack[beam], needed only for --runner beam
  except ImportError as e:
    raise InputFormatError(f"--runner beam needs Apache Beam: pip install 'segpack[beam]' "
                           f"({e})") from e
  finally:
    root.setLevel(level)
  return apache_beam


def raise_input_errors(output: Path) -> None:
  """Raises the first bad input (in input order) that the pipeline reported, if any."""
  path = output / ERRORS_FILE
  if not path.exists():
    return
  errors = json.loads(path.read_text("utf-8"))
  path.unlink()
  raise InputFormatError(errors[0][1] if len(errors) == 1 else
                         f"{errors[0][1]} (and {len(errors) - 1} more bad inputs)")


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

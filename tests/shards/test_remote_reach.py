"""A dataset at a URL that cannot be reached ends with one line naming the URL and the cause,
within a bounded time: an endpoint that refuses connections, and missing credentials."""

import os
import subprocess
import sys
import time

import portpicker
import pytest

pytest.importorskip("apache_beam")
pytest.importorskip("boto3")

from segpack.shards import staging  # noqa: E402
from segpack.shards.format import ShardFormatError  # noqa: E402
from support import paths

ROOT = str(paths.REPO)
CLEAN_AWS = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
             "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_DEFAULT_REGION": "us-east-1"}


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
  return {**env, **CLEAN_AWS, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, **extra}


@pytest.mark.slow
def test_a_refused_endpoint_ends_in_one_line_within_the_bound(tmp_path):
  closed = f"http://127.0.0.1:{portpicker.pick_unused_port()}"  # nothing listens there
  env = _env(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
             AWS_ENDPOINT_URL_S3=closed, SEGPACK_REMOTE_TIMEOUT="3",
             SEGPACK_CACHE=str(tmp_path / "cache"))
  start = time.perf_counter()
  run = subprocess.run(
      [sys.executable, "-m", "train.main", "--config=configs/packed.py:smoke",
       "--config.data.train=s3://no-such-bucket/data", f"--workdir={tmp_path / 'run'}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  elapsed = time.perf_counter() - start
  lines = run.stderr.strip().splitlines()
  assert run.returncode == 2, run.stderr[-3000:]
  assert "Traceback" not in run.stderr and lines[-1].startswith("python -m train.main: error: "), lines
  assert "s3://no-such-bucket/data" in lines[-1] and "cannot be reached" in lines[-1]
  assert elapsed < 120  # bounded: the 3 s wait plus start-up, not the client's minutes


def test_missing_credentials_name_the_url_and_the_cause(tmp_path, monkeypatch):
  for key, value in _env(AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{portpicker.pick_unused_port()}",
                         SEGPACK_REMOTE_TIMEOUT="2").items():
    monkeypatch.setenv(key, value)
  for key in [k for k in os.environ if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                             "AWS_PROFILE", "AWS_SESSION_TOKEN")]:
    monkeypatch.delenv(key)
  with pytest.raises(ShardFormatError, match=r"s3://b/data: cannot be reached: \w+"):
    staging.stage_dataset(url="s3://b/data", cache_dir=tmp_path / "cache", progress=False)
  assert not (tmp_path / "cache").exists()


def test_the_timeout_setting_is_checked(monkeypatch):
  monkeypatch.setenv(staging.TIMEOUT_ENV, "soon")
  with pytest.raises(ShardFormatError, match="SEGPACK_REMOTE_TIMEOUT='soon' must be a number"):
    staging.reach_timeout()
  monkeypatch.setenv(staging.TIMEOUT_ENV, "2.5")
  assert staging.reach_timeout() == 2.5

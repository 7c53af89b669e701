"""`python -m train.bench.hf_import` at a tiny size: the checkpoint it writes loads in full, in its
own dtype, and the memory figures it prints are consistent (no timing or bound assertions: at
20 MB the runtime's own few MB outweigh 10% of the largest tensor)."""

import json
import os
import subprocess
import sys

import pytest
from support import paths

ROOT = str(paths.REPO)
FIELDS = ("checkpoint_bytes", "file_bytes", "largest_tensor", "largest_tensor_bytes",
          "num_tensors", "num_files", "baseline_rss", "peak_rss", "ru_maxrss", "rss_after",
          "peak_above_baseline", "param_bytes", "num_params", "param_dtype", "transient_bytes",
          "bound_bytes", "ok", "load_seconds", "gb_per_s", "num_devices")


def _bench(*args, env=None):
  proc = subprocess.run([sys.executable, "-m", "train.bench.hf_import", "--size-gb", "0.02",
                         *args], cwd=ROOT, capture_output=True, text=True, check=False,
                        env=None if env is None else dict(os.environ, **env))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_figures_of_a_tiny_checkpoint_are_consistent(tmp_path, dtype):
  r = json.loads(_bench("--dtype", dtype, "--workdir", str(tmp_path), "--json"))
  assert all(key in r for key in FIELDS), sorted(set(FIELDS) - set(r))
  assert r["checkpoint_bytes"] >= 0.02e9 and r["dtype"] == r["param_dtype"] == dtype
  assert 0 < r["largest_tensor_bytes"] <= r["checkpoint_bytes"] <= r["file_bytes"]
  # Every tensor became a parameter, in the checkpoint's dtype: the same bytes.
  assert r["param_bytes"] == r["checkpoint_bytes"] and r["num_params"] == r["num_tensors"]
  assert r["num_devices"] == 1 and r["num_files"] == r["layers"] + 2
  assert 0 < r["baseline_rss"] and r["peak_rss"] >= r["rss_after"] >= r["baseline_rss"]
  assert r["peak_above_baseline"] == r["peak_rss"] - r["baseline_rss"] >= r["param_bytes"]
  assert r["transient_bytes"] == r["peak_above_baseline"] - r["param_bytes"]
  assert r["ok"] == (r["transient_bytes"] <= r["bound_bytes"])
  # --workdir keeps the checkpoint: a Llama config.json and an index naming every file.
  model_dir = r["model_dir"]
  with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  assert config["model_type"] == "llama" and config["torch_dtype"] == dtype
  with open(os.path.join(model_dir, "model.safetensors.index.json"), encoding="utf-8") as f:
    index = json.load(f)
  assert index["metadata"]["total_size"] == r["checkpoint_bytes"]
  assert len(index["weight_map"]) == r["num_tensors"]
  assert len(set(index["weight_map"].values())) == r["num_files"]


def test_table_and_temporary_directory(tmp_path):
  out = _bench(env=dict(TMPDIR=str(tmp_path)))
  assert not os.listdir(tmp_path)  # the checkpoint's temporary directory is deleted
  for label in ("checkpoint", "largest tensor", "baseline RSS", "peak RSS", "loader transient",
                "transient <= 1.1 x largest", "load time"):
    assert label in out, out

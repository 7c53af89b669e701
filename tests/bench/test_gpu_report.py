"""python -m segpack.bench.gpu_report on the CPU; the GPU checks catching planted bugs.

The report's `--platform cpu --quick` run (Pallas interpreted, cuDNN unsupported) proves the
command and its JSON end to end; the broken-attention tests prove the checks can fail.
"""

import dataclasses
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segpack.attention import segment_attention
from segpack.bench import gpu_cases
from segpack.bench import gpu_checks
from segpack.bench import gpu_report


def test_report_on_the_cpu_end_to_end(tmp_path, capsys):
  out = tmp_path / "report.json"
  assert gpu_report.main(["--platform", "cpu", "--quick", "--out", str(out), "--jobs", "2"]) == 0
  assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # atomic: no temporary left
  report = json.loads(out.read_text())
  assert report["complete"] is True and report["mode"] == "cpu"
  assert report["device"]["platform"] == "cpu"
  assert {"python", "jax", "jaxlib", "segpack", "cuda_plugin", "cudnn"} <= set(report["versions"])
  datetime.datetime.fromisoformat(report["date"])
  checks = report["checks"]
  assert [c["id"] for c in checks] == [p.id for p in gpu_cases.grid(gpu_cases.CPU_GRID)]
  for rec in checks:
    if rec["implementation"] == "cudnn":
      assert rec["status"].startswith("unsupported: CudnnUnavailableError"), rec["status"]
      continue
    assert rec["status"] == "passed", rec["failures"]
    for t in gpu_checks.TENSORS:
      assert 0 < rec["errors"][t] <= rec["tolerance"]["error"][t]
      assert 0 < rec["xla"]["error"][t] < 0.01  # bf16 against the float32 reference
      assert rec["pad_max_abs"][t] == 0
      assert len(rec["row_errors"][t]) == rec["batch"] and rec["row_errors"][t][-1] is None
  assert report["cudnn_memory"]["status"].startswith("unsupported")
  statuses = [c["status"].split(":")[0] for c in checks + [report["cudnn_memory"]]]
  assert report["summary"] == {s: statuses.count(s) for s in ("passed", "failed", "unsupported")}
  assert [(b["seq_len"], b["timings"]) for b in report["benchmark"]] == [(256, "not measured")]
  assert report["context_parallel"]["status"] == "not yet measured"  # needs more than one GPU
  printed = capsys.readouterr().out
  assert "context-parallel step times: not yet measured (" in printed
  assert "pallas   bf16       1      0       0" in printed and "1 passed, 0 failed" in printed


def test_report_refuses_to_run_without_a_gpu(tmp_path, capsys):
  if jax.default_backend() == "gpu":
    pytest.skip("checks the refusal on a machine without a GPU")
  out = tmp_path / "report.json"
  assert gpu_report.main(["--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "needs a CUDA GPU: jax.default_backend() is 'cpu'" in err and "--platform cpu" in err
  assert not out.exists()


def test_grid_ids_are_readable_and_unique():
  points = gpu_cases.grid()
  assert len(points) == 2 * 3 * 4 * 3 * 2 * 2
  assert len({p.id for p in points}) == len(points)
  assert points[0].id == "pallas-f32-D64-S1000-mha-causal"
  assert points[1].id == "cudnn-f32-D64-S1000-mha-causal"  # backends share a yardstick
  assert "cudnn-f16-D256-S8192-gqa-full" in {p.id for p in points}


def _runs(row):
  change = np.flatnonzero(np.diff(row)) + 1
  starts, ends = np.r_[0, change], np.r_[change, len(row)]
  return [(int(row[a]), int(b - a)) for a, b in zip(starts, ends)]


def test_case_rows_are_packed_rows_and_the_edge_rows():
  case = gpu_cases.make_case(seq_len=1000, head_dim=80, num_heads=4, num_kv_heads=1)
  seg = case.segment_ids
  assert seg.shape == (5, 1000) and case.shape == (5, 1000, 4, 1, 80)
  for row in seg[:2]:  # packed rows: documents 1, 2, ... then padding
    ids = [sid for sid, _ in _runs(row) if sid]
    assert ids == list(range(1, len(ids) + 1))
  assert _runs(seg[2]) == [(1, 1000)]  # one document filling the row
  runs = _runs(seg[3])
  assert [n for _, n in runs[:8]] == [1] * 8  # length-1 segments
  assert runs[-1] == (0, 100)  # a padding tail
  assert 0 in [sid for sid, _ in runs[:-1]]  # a padding gap between documents
  assert not seg[4].any()  # all padding
  n = case.cudnn_segment_bound
  assert n >= 32 and n & (n - 1) == 0 and n >= max(len(_runs(r)) for r in seg)


@dataclasses.dataclass(frozen=True)
class _Broken:
  """XLA attention with one planted bug (a hashable `Attention` stand-in)."""

  bug: str
  causal: bool = True

  def __call__(self, q, k, v, seg):
    if self.bug == "leak":  # documents see each other: every non-padding slot in one segment
      seg = jnp.where(seg != 0, 1, 0)
    out = segment_attention(q, k, v, seg, causal=self.causal, implementation="xla")
    if self.bug == "padding":
      return out + (seg == 0)[:, :, None, None].astype(out.dtype)
    if self.bug == "one_slot":  # a length-1 segment of the edge row, 2% off
      return out.at[3, 2].multiply(1.02)
    return out


@pytest.fixture(scope="module")
def bf16_yardstick():
  case = gpu_cases.make_case(seq_len=1000, head_dim=32, num_heads=4, num_kv_heads=2)
  yard = gpu_checks.make_yardstick(case=case, dtype="bfloat16", causal=True)
  assert yard.error is None, yard.error
  return yard


@pytest.mark.parametrize("bug,expected", [
    ("none", []),
    ("leak", ["out: relative error", "dq: relative error", "dk: relative error",
              "dv: relative error"]),
    ("padding", ["out: 1 at padding slots"]),
    ("one_slot", ["out: worst slot", "dv: worst slot"]),  # dv: the slot's cotangent x 1.02
])
def test_the_rule_catches_planted_bugs(bf16_yardstick, bug, expected):
  """A 2% error in one slot of 4,000 stays under the norm's tolerance; the worst slot sees it."""
  yard = bf16_yardstick
  exe = gpu_checks.compile_now(*gpu_checks.compare_program(_Broken(bug), yard.case, "bfloat16"))
  got = gpu_checks.summarize_stats(exe(*yard.inputs, *yard.reference), yard.case.segment_ids)
  _, failures = gpu_checks.judge(got, yard.xla, dtype="bfloat16")
  for prefix in expected:
    assert any(f.startswith(prefix) for f in failures), (prefix, failures)
  if bug in ("none", "one_slot"):
    assert len(failures) == len(expected), failures

"""Context-parallel step timing (segpack.bench.context_step) on the 8 forced CPU devices.

The timed program must compute the right thing: its outputs and gradients, put back in natural
order, are compared with the float64 per-document oracle of `test_attention_oracle` for every
order. The times themselves mean nothing on the CPU; only their bookkeeping is checked. Where
no GPU exists the benchmark and the GPU report say "not yet measured".
"""

import json

import numpy as np
import pytest

from segpack.bench import attention_context
from segpack.bench import context_step
from segpack.bench import gpu_report
from segpack.data import context_order as order_lib
from support.attention_oracle import reference

S = 256
DIMS = dict(heads=4, kv_heads=2, head_dim=16)


def _rows():
  """Two FFD-packed rows (padding tail) and one document spanning the whole row."""
  seg = attention_context.packed_rows(S, num_rows=2, mean=60, sigma=1.0, seed=3)
  return np.concatenate([seg, np.full((1, S), 5, np.int32)])


def test_time_orders_computes_the_unsharded_attention_for_every_order():
  seg = _rows()
  records = context_step.time_orders(
      mesh=context_step.context_mesh(4), segment_ids_BxS=seg, dtype="float32",
      implementation="xla", warmup=1, repeats=2, seed=7, platform_check=False,
      keep_outputs=True, **DIMS)
  assert [r["balance"] for r in records] == list(order_lib.CONTEXT_BALANCES)
  assert records[0]["ratio_to_none"] == 1.0
  for r in records:
    assert r["step_ms"] > 0 and r["context_size"] == 4 and r["seq_len"] == S and r["rows"] == 3
    assert r["ratio_to_none"] == pytest.approx(r["step_ms"] / records[0]["step_ms"])
    assert r["max_over_mean"] >= 1.0
  # "documents" minimises every row's busiest device, so the sum over rows too here.
  assert records[2]["max_over_mean"] < records[0]["max_over_mean"]
  x = context_step.random_inputs(segment_ids_BxS=seg, dtype="float32", seed=7, **DIMS)
  want_out, want_grads = reference(x["q"], x["k"], x["v"], seg, causal=True, dout=x["dout"])
  for r in records:
    for name, got, want in zip(("out", "dq", "dk", "dv"), r["outputs"],
                               (want_out, *want_grads)):
      np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-3,
                                 err_msg=f"{r['balance']} {name}")


def test_time_orders_refuses_without_a_gpu_unless_told():
  assert context_step.skip_reason(4) == "needs a GPU, jax.default_backend() is 'cpu'"
  with pytest.raises(ValueError, match="step times needs a GPU"):
    context_step.time_orders(mesh=context_step.context_mesh(2), segment_ids_BxS=_rows(),
                             implementation="xla", **DIMS)
  with pytest.raises(ValueError, match="balances must start with 'none'"):
    context_step.time_orders(mesh=context_step.context_mesh(2), segment_ids_BxS=_rows(),
                             balances=("zigzag", "none"), platform_check=False, **DIMS)
  with pytest.raises(ValueError, match="context_size=16 needs that many devices, 8 given"):
    context_step.context_mesh(16)


def test_benchmark_fills_the_step_column_where_it_can_measure(capsys, monkeypatch):
  argv = ["--seq-lens", "256", "--context-sizes", "2", "--means", "60", "--rows", "2",
          "--min-rows", "2", "--repeats", "1", "--step-repeats", "1",
          "--step-implementation", "xla", "--json"]
  assert attention_context.main(argv) == 0
  (rec,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert rec["step_ms"] == "not yet measured" and "needs a GPU" in rec["step_note"]
  monkeypatch.setattr(context_step, "skip_reason", lambda context_size: None)  # CPU as a GPU
  assert attention_context.main(argv) == 0
  (rec,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert set(rec["step_ms"]) == set(order_lib.CONTEXT_BALANCES) and rec["step_rows"] == 1
  assert all(ms > 0 for ms in rec["step_ms"].values()) and rec["step_ratio"]["none"] == 1.0
  assert attention_context.main(argv[:-1]) == 0
  line = capsys.readouterr().out.splitlines()[2]
  assert line.count(" / ") == 2 and "(documents " in line and "not yet" not in line


def test_gpu_report_context_section(monkeypatch):
  section = gpu_report.context_parallel_timing(on_gpu=False)
  assert section["status"] == "not yet measured"
  assert "need more than one GPU; this run has 8 cpu device(s)" in section["reason"]
  assert gpu_report.format_context(section).startswith(
      "context-parallel step times: not yet measured (")
  calls = []

  def fake_time_orders(**kw):
    calls.append(kw)
    return [dict(balance=b, step_ms=2.0 + i, ratio_to_none=1.0 + i / 2, max_over_mean=1.0)
            for i, b in enumerate(order_lib.CONTEXT_BALANCES)]

  monkeypatch.setattr(context_step, "time_orders", fake_time_orders)
  monkeypatch.setattr(gpu_report.jax, "device_count", lambda: 6)
  section = gpu_report.context_parallel_timing(on_gpu=True)
  assert section["status"] == "measured" and section["context_size"] == 4
  assert [kw["mesh"].shape["context"] for kw in calls] == [4, 4]  # 6 GPUs: cp = 4
  assert {kw["implementation"] for kw in calls} == {"pallas"}
  assert [kw["segment_ids_BxS"].shape for kw in calls] == [(1, 32768)] * 2
  assert [(r["mean"], r["balance"]) for r in section["records"]] == [
      (m, b) for m in gpu_report.CP_MEANS for b in order_lib.CONTEXT_BALANCES]
  assert "documents      4.00 ms  x2.000" in gpu_report.format_context(section)

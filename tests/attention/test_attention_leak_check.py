"""`segpack.attention.self_check` (segpack/attention/leak_check.py): passes real backends, catches
leaking ones (forward or gradient).

The leaking backends are test doubles built on the XLA backend with altered segment ids, so the
place and size of each leak are known.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segpack.attention import AttentionInputError, AttentionLeakError, PallasOptions, self_check
from segpack.attention import cudnn as cudnn_lib
from segpack.attention import dispatch
from segpack.attention import leak_check as self_check_lib
from segpack.attention import xla as xla_lib
from support.attention_oracle import reference
from support.train_configs import synthetic_config
from train import train as train_lib


def ignores_segments(q, k, v, segment_ids, *, causal, scale):
  """Plain causal attention over the whole row: every document sees the ones before it."""
  return xla_lib.segment_attention_xla(q, k, v, jnp.ones_like(segment_ids), causal=causal,
                                       scale=scale)


@jax.custom_vjp
def _masked_forward_unmasked_backward(q, k, v, segment_ids):
  return xla_lib.segment_attention_xla(q, k, v, segment_ids, causal=True, scale=0.25)


def _fwd(q, k, v, segment_ids):
  return _masked_forward_unmasked_backward(q, k, v, segment_ids), (q, k, v, segment_ids)


def _bwd(residuals, dout):
  q, k, v, segment_ids = residuals
  one_segment = (segment_ids != 0).astype(segment_ids.dtype)  # padding kept, documents merged
  _, vjp = jax.vjp(lambda q, k, v: xla_lib.segment_attention_xla(
      q, k, v, one_segment, causal=True, scale=0.25), q, k, v)
  return (*vjp(dout), None)


_masked_forward_unmasked_backward.defvjp(_fwd, _bwd)


def leaks_in_backward_only(q, k, v, segment_ids, *, causal, scale):
  """The right forward; the backward of attention over all real tokens of the row."""
  assert causal and scale == 0.25  # the probe's head dim is 16
  return _masked_forward_unmasked_backward(q, k, v, segment_ids)


def merges_two_documents(q, k, v, segment_ids, *, causal, scale):
  """Row 1's segment 4 (one token at slot 83) is attended as part of segment 3 (slots 74..82)."""
  merged = segment_ids.at[1].set(jnp.where(segment_ids[1] == 4, 3, segment_ids[1]))
  return xla_lib.segment_attention_xla(q, k, v, merged, causal=causal, scale=scale)


def nan_at_padding(q, k, v, segment_ids, *, causal, scale):
  """Right on every document, NaN at padding queries (e.g. a 0/0 in an empty softmax row)."""
  out = xla_lib.segment_attention_xla(q, k, v, segment_ids, causal=causal, scale=scale)
  return jnp.where((segment_ids == 0)[:, :, None, None], jnp.nan, out)


def test_probe_batch_has_short_long_and_padding_runs():
  seg = self_check_lib.probe_segment_ids()
  assert seg.shape == (2, 128)
  lengths = [e - s for _, s, e in self_check_lib._documents()]  # pylint: disable=protected-access
  assert min(lengths) == 1 and max(lengths) > 64 and lengths.count(1) >= 3
  assert np.all(seg[:, -14:] == 0) and np.all(seg[1, 71:74] == 0)  # tail and in-between padding


def test_oracle_matches_the_float64_per_document_reference():
  """The check's oracle (XLA, documents alone) against the independent NumPy oracle."""
  q, k, v, dout = self_check_lib._probe_inputs(jnp.float32, 3)  # pylint: disable=protected-access
  got = self_check_lib._oracle(q, k, v, dout, scale=0.25)  # pylint: disable=protected-access
  want, grads = reference(q, k, v, self_check_lib.probe_segment_ids(), causal=True, scale=0.25,
                          dout=dout)
  for name, g, w in zip(self_check_lib.TENSORS, got, (want, *grads)):
    np.testing.assert_allclose(g, w, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("implementation,kwargs", [
    ("xla", {}),
    ("pallas", dict(pallas=PallasOptions(interpret=True))),
    ("pallas", dict(pallas=PallasOptions(interpret=True, block_q=32, block_k=16, block_q_bwd=16,
                                         block_k_bwd=32))),
])
def test_real_backends_pass(implementation, kwargs):
  result = self_check(implementation=implementation, **kwargs)
  assert result.implementation == implementation and result.dtype == "float32"
  assert set(result.max_errors) == {"out", "dq", "dk", "dv"}
  assert max(result.max_errors.values()) < 1e-4, result.max_errors


def test_xla_in_bfloat16_passes_and_a_bfloat16_leak_is_caught():
  result = self_check(implementation="xla", dtype=jnp.bfloat16)
  assert result.dtype == "bfloat16" and max(result.max_errors.values()) < 3e-2
  with pytest.raises(AttentionLeakError, match=r"`out`.*\(bfloat16\)"):
    self_check(implementation=ignores_segments, dtype=jnp.bfloat16)


def test_backend_ignoring_segment_ids_is_caught():
  with pytest.raises(AttentionLeakError) as info:
    self_check(implementation=ignores_segments)
  msg = str(info.value)
  assert "implementation 'ignores_segments' leaks across documents: `out`" in msg
  assert re.search(r"by ([\d.e+-]+) > tolerance 0\.0001 \(float32\) at row \d, slot \d+", msg)
  assert float(re.search(r"by ([\d.e+-]+) >", msg).group(1)) > 0.1


def test_leak_in_the_gradient_only_is_caught():
  with pytest.raises(AttentionLeakError) as info:
    self_check(implementation=leaks_in_backward_only)
  msg = str(info.value)
  assert "'leaks_in_backward_only' leaks across documents: `dq`" in msg
  assert "tolerance 0.001 (float32)" in msg
  errors = dict(re.findall(r"(out|dq|dk|dv)=([\d.e+-]+)", msg))
  assert float(errors["out"]) < 1e-5  # the forward is right
  assert all(float(errors[t]) > 0.1 for t in ("dq", "dk", "dv"))


def test_one_merged_boundary_is_located():
  with pytest.raises(AttentionLeakError,
                     match=r"`out` .* at row 1, slot 83 \(segment 4, a document of length 1 at "
                           r"slots 83\.\.83\), query head \d"):
    self_check(implementation=merges_two_documents)


def test_non_finite_padding_output_is_caught():
  with pytest.raises(AttentionLeakError, match=r"`out` .* by inf .* \(a padding slot\)"):
    self_check(implementation=nan_at_padding)


def test_unknown_implementation_is_refused_naming_it():
  with pytest.raises(AttentionInputError, match="'flash'"):
    self_check(implementation="flash")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="None means XLA only off a GPU")
def test_settings_go_to_their_backend_and_none_is_the_default():
  """The settings rule of `segment_attention` (`resolve_implementation`) holds for `self_check`;
  `implementation=None` checks the platform's default backend."""
  assert self_check().implementation == "xla"
  with pytest.raises(AttentionInputError, match="`pallas`=.* implementation='xla' does not use"):
    self_check(implementation="xla", pallas=PallasOptions(interpret=True))
  with pytest.raises(AttentionInputError, match="`cudnn_segment_bound`=16 is a cuDNN setting"):
    self_check(implementation="pallas", pallas=PallasOptions(interpret=True),
               cudnn_segment_bound=16)
  with pytest.raises(AttentionInputError, match="a callable `implementation` takes neither"):
    self_check(implementation=ignores_segments, pallas=PallasOptions(interpret=True))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error without a GPU")
def test_cudnn_without_a_gpu_raises_cudnn_unavailable():
  with pytest.raises(cudnn_lib.CudnnUnavailableError):
    self_check(implementation="cudnn")


def _leaking_run_config():
  return synthetic_config(**{"attention.implementation": "xla", "train.num_steps": 1,
                       "train.eval_every": 0, "train.log_batches": False})


def test_trainer_refuses_to_train_on_a_leaking_backend(tmp_path, monkeypatch):
  """`attention.implementation="xla"` dispatching to a backend that ignores segment ids: the run
  stops in setup, before the workdir is created."""
  monkeypatch.setattr(dispatch, "segment_attention_xla", ignores_segments)
  with pytest.raises(AttentionLeakError, match="implementation 'xla' leaks across documents"):
    train_lib.train_and_evaluate(_leaking_run_config(), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_trainer_self_check_can_be_turned_off(tmp_path, monkeypatch):
  calls = []

  def leaking_and_counted(*args, **kwargs):
    calls.append(1)
    return ignores_segments(*args, **kwargs)

  monkeypatch.setattr(dispatch, "segment_attention_xla", leaking_and_counted)
  c = _leaking_run_config()
  c.attention.self_check = False
  summary = train_lib.train_and_evaluate(c, str(tmp_path))
  assert summary["steps"] == 1 and np.isfinite(summary["final_loss"])
  assert calls  # the (leaking) backend did run, in the model, unchecked

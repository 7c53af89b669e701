"""A JAX without Pallas's Triton backend (`jax.experimental.pallas.triton`, deprecated from JAX
0.11): segpack imports, XLA attention runs, Pallas interpret mode runs, and Pallas's GPU kernels
are refused in one line naming the other backends; `implementation=None` on a GPU picks cuDNN
with one warning. The backend's absence is simulated in a new process (`sys.modules[name] =
None`, so that importing it raises ImportError); the same process without that line is the
negative control: the module imports there, but only once a kernel is built."""

import json
import os
import subprocess
import sys

from support import paths

TRITON = "jax.experimental.pallas.triton"
BLOCK = f"import sys; sys.modules[{TRITON!r}] = None\n"
PROBE = f"""
import json, sys, warnings
import numpy as np
import jax.numpy as jnp
import segpack
from segpack import attention
out = {{"imported": {TRITON!r} in sys.modules and sys.modules[{TRITON!r}] is not None}}
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=(1, 32, 2, 16)), jnp.float32) for _ in range(3))
seg = jnp.asarray([[1] * 12 + [2] * 14 + [0] * 6])
xla = attention.segment_attention(q, k, v, seg, implementation="xla")
interp = attention.segment_attention(q, k, v, seg, implementation="pallas",
                                     pallas=attention.PallasOptions(interpret=True))
out["xla_vs_interpret"] = float(jnp.max(jnp.abs(xla - interp)[:, :26]))
out["imported_after_kernel"] = sys.modules.get({TRITON!r}) is not None
try:
  out["explicit"] = attention.resolve_implementation(implementation="pallas")
except attention.AttentionInputError as e:
  out["explicit"] = "error: " + str(e)
try:
  attention.segment_attention(q, k, v, seg, implementation="pallas")
  out["call"] = "ran"
except attention.AttentionInputError as e:
  out["call"] = "error: " + str(e)
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  out["default_gpu"] = [attention.default_implementation(platform=p) for p in ("gpu", "cuda")]
out["warnings"] = [str(w.message) for w in caught]
out["default_cpu"] = attention.default_implementation(platform="cpu")
print(json.dumps(out))
"""


def _probe(blocked: bool) -> dict:
  code = (BLOCK if blocked else "") + PROBE
  done = subprocess.run([sys.executable, "-c", code], cwd=paths.REPO, capture_output=True,
                        text=True, timeout=300,
                        env={**os.environ, "PYTHONPATH": str(paths.REPO)})
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_the_triton_backend_segpack_runs_and_pallas_is_refused_in_one_line():
  got = _probe(blocked=True)
  assert not got["imported"] and not got["imported_after_kernel"]
  assert got["xla_vs_interpret"] < 1e-5  # interpret mode runs without the Triton backend
  for refusal in (got["explicit"], got["call"]):
    assert refusal.startswith("error: segment_attention: implementation='pallas' needs "), refusal
    assert "\n" not in refusal and TRITON in refusal
    assert "implementation='cudnn'" in refusal and "implementation='xla'" in refusal
  assert got["default_gpu"] == ["cudnn", "cudnn"] and got["default_cpu"] == "xla"
  (warning,) = got["warnings"]  # once per process, in one line
  assert "\n" not in warning and TRITON in warning and "runs 'cudnn' instead of 'pallas'" in warning


def test_negative_control_with_the_triton_backend_it_is_imported_by_the_kernels_alone():
  got = _probe(blocked=False)
  assert not got["imported"]  # `import segpack` leaves it alone ...
  assert got["imported_after_kernel"]  # ... and building a Pallas kernel imports it
  assert got["xla_vs_interpret"] < 1e-5
  assert got["explicit"] == "pallas" and got["call"].startswith("error: ")  # the CPU refusal
  assert "interpret=True" in got["call"]
  assert got["default_gpu"] == ["pallas", "pallas"] and not got["warnings"]

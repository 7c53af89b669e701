"""An independent NumPy oracle for segment attention: every document attended alone, in float64.

Forward and a hand-written backward (no JAX), used by the other attention tests. The tests here
check the oracle itself against finite differences.
"""

import numpy as np
from support.attention_oracle import _doc_attention, _runs, reference  # noqa: F401


def test_oracle_gradients_match_finite_differences():
  rng = np.random.default_rng(0)
  b, s, h, kh, d = 1, 9, 2, 1, 4
  q, k, v = rng.normal(size=(b, s, h, d)), rng.normal(size=(b, s, kh, d)), rng.normal(
      size=(b, s, kh, d))
  seg = np.array([[1, 1, 1, 1, 2, 2, 2, 0, 0]])
  dout = rng.normal(size=(b, s, h, d))
  for causal in (True, False):
    _, (dq, dk, dv) = reference(q, k, v, seg, causal=causal, dout=dout)
    for x, grad in ((q, dq), (k, dk), (v, dv)):
      for idx in [(0, 1, 0, 2), (0, 5, 0, 1), (0, 3, 0, 0)]:
        e = np.zeros_like(x)
        e[idx] = 1e-6
        args = [q, k, v]
        pos = [a is x for a in args].index(True)
        plus, minus = list(args), list(args)
        plus[pos], minus[pos] = x + e, x - e
        f = lambda a: (reference(*a, seg, causal=causal)[0] * dout).sum()
        fd = (f(plus) - f(minus)) / 2e-6
        np.testing.assert_allclose(grad[idx], fd, rtol=1e-5, atol=1e-7)


def test_oracle_is_per_document_and_zero_on_padding():
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=(1, 6, 1, 3)) for _ in range(3))
  seg = np.array([[1, 1, 2, 2, 2, 0]])
  out, _ = reference(q, k, v, seg, causal=False)
  # The first token of document 2 sees the three keys of document 2 only.
  logits = q[0, 2, 0] @ k[0, 2:5, 0].T / np.sqrt(3)
  w = np.exp(logits) / np.exp(logits).sum()
  np.testing.assert_allclose(out[0, 2, 0], w @ v[0, 2:5, 0])
  assert np.all(out[0, 5] == 0)
  # Causal: the first token of a document sees only itself.
  out_c, _ = reference(q, k, v, seg, causal=True)
  np.testing.assert_allclose(out_c[0, 2, 0], v[0, 2, 0])

"""An independent NumPy oracle for segment attention: every document attended alone, in
float64. Forward and a hand-written backward (no JAX); tests/attention/test_attention_oracle.py
checks it against finite differences."""

import numpy as np


def _runs(row):
  """(start, end) of every non-zero run of a row of segment ids."""
  runs, s = [], len(row)
  i = 0
  while i < s:
    j = i
    while j < s and row[j] == row[i]:
      j += 1
    if row[i] != 0:
      runs.append((i, j))
    i = j
  return runs


def _doc_attention(q, k, v, do, causal, scale):
  """One document, one head: q [L, D], k/v [L, D]; returns out and (dq, dk, dv) for `do`."""
  logits = q @ k.T * scale
  if causal:
    logits = np.where(np.tril(np.ones(logits.shape, bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = p @ v
  if do is None:
    return out, None
  dv = p.T @ do
  dp = do @ v.T
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  return out, (ds @ k * scale, ds.T @ q * scale, dv)


def reference(q, k, v, segment_ids, *, causal, scale=None, dout=None):
  """Per-document attention in float64.

  Args:
    q: [B, S, H, D]; k, v: [B, S, K, D]; segment_ids: [B, S] with 0 = padding.
    causal: causal within each document.
    scale: default 1/sqrt(D).
    dout: optional output cotangent [B, S, H, D].

  Returns:
    out [B, S, H, D] (zeros at padding), and (dq, dk, dv) if `dout` is given, else None.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  seg = np.asarray(segment_ids)
  b, s, h, d = q.shape
  g = h // k.shape[2]
  scale = 1 / np.sqrt(d) if scale is None else scale
  out = np.zeros_like(q)
  grads = None if dout is None else (np.zeros_like(q), np.zeros_like(k), np.zeros_like(v))
  do_all = None if dout is None else np.asarray(dout, np.float64)
  for bi in range(b):
    for start, end in _runs(seg[bi]):
      for hi in range(h):
        kh = hi // g
        sl = slice(start, end)
        do = None if do_all is None else do_all[bi, sl, hi]
        o, gr = _doc_attention(q[bi, sl, hi], k[bi, sl, kh], v[bi, sl, kh], do, causal, scale)
        out[bi, sl, hi] = o
        if gr is not None:
          grads[0][bi, sl, hi] += gr[0]
          grads[1][bi, sl, kh] += gr[1]
          grads[2][bi, sl, kh] += gr[2]
  return out, grads

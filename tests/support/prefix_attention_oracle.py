"""An independent NumPy oracle for segment attention with shared prefixes, in float64.

The mask is written out query by query from the rule of `segment_attention(prefix_segment_ids=
...)`: query `q` sees key `k` iff `seg[q] != 0`, `k <= q` when causal, and `seg[k] == seg[q]` or
(`pre[q] != 0` and `seg[k] == pre[q]`). Attention then runs one query at a time, forward and a
hand-written backward (no JAX, no segpack code). Also the pair rows of the tests: prompts with
one or two branches, ordinary segments and padding, with ids in a random order.
"""

import numpy as np


def prefix_mask(seg_row, pre_row, *, causal):
  """The boolean `[S, S]` mask of one row, `mask[q, k]`, built one query at a time."""
  seg_row, pre_row = np.asarray(seg_row), np.asarray(pre_row)
  s = len(seg_row)
  mask = np.zeros((s, s), bool)
  for q in range(s):
    if seg_row[q] == 0:
      continue
    seen = seg_row == seg_row[q]
    if pre_row[q] != 0:
      seen |= seg_row == pre_row[q]
    if causal:
      seen &= np.arange(s) <= q
    mask[q] = seen
  return mask


def prefix_reference(q, k, v, segment_ids, prefix_segment_ids, *, causal, scale=None,
                     dout=None):
  """Masked attention in float64, one query (and head) at a time.

  Args:
    q: [B, S, H, D]; k, v: [B, S, K, D]; segment_ids, prefix_segment_ids: [B, S].
    causal: keys after the query are hidden.
    scale: default 1/sqrt(D).
    dout: optional output cotangent [B, S, H, D].

  Returns:
    out [B, S, H, D] (zeros at padding), and (dq, dk, dv) if `dout` is given, else None.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  seg, pre = np.asarray(segment_ids), np.asarray(prefix_segment_ids)
  b, s, h, d = q.shape
  g = h // k.shape[2]
  scale = 1 / np.sqrt(d) if scale is None else scale
  out = np.zeros_like(q)
  grads = None if dout is None else (np.zeros_like(q), np.zeros_like(k), np.zeros_like(v))
  do_all = None if dout is None else np.asarray(dout, np.float64)
  for bi in range(b):
    mask = prefix_mask(seg[bi], pre[bi], causal=causal)
    for qi in range(s):
      keys = np.flatnonzero(mask[qi])
      if len(keys) == 0:
        continue
      for hi in range(h):
        kh = hi // g
        kk, vv = k[bi, keys, kh], v[bi, keys, kh]
        logits = kk @ q[bi, qi, hi] * scale
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[bi, qi, hi] = p @ vv
        if grads is None:
          continue
        do = do_all[bi, qi, hi]
        dp = vv @ do
        ds = p * (dp - p @ dp)
        grads[0][bi, qi, hi] += ds @ kk * scale
        grads[1][bi, keys, kh] += np.outer(ds, q[bi, qi, hi]) * scale
        grads[2][bi, keys, kh] += np.outer(p, do)
  return out, grads


def pair_rows(rng, n, s):
  """Rows of preference pairs of very different lengths, with prompts stored once.

  Each row holds, in random order of kind: a prompt followed by two branches (chosen,
  rejected), a prompt with one branch, ordinary segments; sometimes padding between them and
  a padding tail. Segment ids are distinct random positive ints (not in row order).

  Returns:
    `(segment_ids, prefix_segment_ids)`, int32 `[n, s]` each.
  """
  seg, pre = np.zeros((n, s), np.int32), np.zeros((n, s), np.int32)
  lengths = [1, 2, 5, 13, 29, 47]
  for r in range(n):
    ids = iter(rng.permutation(np.arange(1, 10 * s))[: s].tolist())
    pos, misses = int(rng.integers(0, 2)), 0
    while misses < 4:
      kind = rng.choice(["two", "one", "plain"], p=[0.5, 0.25, 0.25])
      parts = 1 + {"two": 2, "one": 1, "plain": 0}[kind]
      sizes = [int(rng.choice(lengths)) for _ in range(parts)]
      if pos + sum(sizes) > s:
        misses += 1
        continue
      prompt = next(ids)
      for i, size in enumerate(sizes):
        sid = prompt if i == 0 else next(ids)
        seg[r, pos:pos + size] = sid
        pre[r, pos:pos + size] = prompt if i > 0 else 0
        pos += size
      pos += int(rng.random() < 0.2)
  return seg, pre

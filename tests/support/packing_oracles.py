"""Independent oracles for the packing tests: one item at a time, straight from the textbook.

None of them uses segpack; the `naive_*` loops are O(items x bins), `tree_ffd` and `bisect_bfd`
place items one by one with a tree / bisection, fast enough for thousands of bins.
"""

import bisect

import numpy as np


def naive_chunks(lengths, seq_len, *, long_docs="split", min_len=0, overlap=0, extra_tokens=0):
  """[(doc, start, length)] in document order, built slot by slot."""
  out = []
  for d, n in enumerate(lengths):
    if n < min_len:
      continue
    v = n + extra_tokens
    if v == 0:
      continue
    start = 0
    while True:
      out.append((d, start, min(seq_len, v - start)))
      if start + seq_len >= v or long_docs == "truncate":
        break
      start += seq_len - overlap
  return out


def naive_ffd(sizes, cap):
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  room, bins = [], []
  for i in order:
    for b, r in enumerate(room):
      if r >= sizes[i]:
        room[b] -= sizes[i]
        bins[b].append(i)
        break
    else:
      room.append(cap - sizes[i])
      bins.append([i])
  return bins


def naive_bfd(sizes, cap):
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  room, bins = [], []
  for i in order:
    best = None
    for b, r in enumerate(room):
      if r >= sizes[i] and (best is None or r < room[best]):
        best = b
    if best is None:
      room.append(cap - sizes[i])
      bins.append([i])
    else:
      room[best] -= sizes[i]
      bins[best].append(i)
  return bins


def naive_next_fit(sizes, cap):
  bins, used = [], cap + 1
  for i, s in enumerate(sizes):
    if used + s > cap:
      bins.append([])
      used = 0
    bins[-1].append(i)
    used += s
  return bins


NAIVE = {"ffd": naive_ffd, "bfd": naive_bfd, "greedy": naive_next_fit,
         "pad": lambda sizes, cap: [[i] for i in range(len(sizes))],
         "sorted_pad": lambda sizes, cap: [[i] for i in
                                           sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))]}


def plan_rows(p):
  """The plan as [[(doc, start, length), ...] per row]."""
  return [p.row(r) for r in range(p.num_rows)]


def random_lengths(rng, n, seq_len):
  kind = rng.integers(4)
  if kind == 0:  # lognormal, some longer than a row
    return np.round(rng.lognormal(np.log(seq_len / 4), 1.0, n)).astype(np.int64)
  if kind == 1:  # few distinct lengths: long runs of equal sizes
    return rng.choice(rng.integers(1, seq_len + 1, 4), n)
  if kind == 2:  # uniform up to twice a row
    return rng.integers(0, 2 * seq_len, n)
  return rng.integers(1, max(2, seq_len // 3), n)  # many small


def tree_ffd(sizes, cap):
  """First fit, one item at a time, with a max segment tree over bins (leftmost room >= s)."""
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  size = 1
  while size < len(sizes):
    size *= 2
  tree = [-1] * (2 * size)  # room of bin b at leaf size + b; -1 = not open
  bins, num_bins = [], 0
  for i in order:
    s = sizes[i]
    if tree[1] >= s:
      node = 1
      while node < size:
        node = 2 * node if tree[2 * node] >= s else 2 * node + 1
      b = node - size
      bins[b].append(i)
    else:
      b, num_bins = num_bins, num_bins + 1
      bins.append([i])
      node = size + b
      tree[node] = cap
    tree[size + b] -= s
    node = (size + b) // 2
    while node:
      tree[node] = max(tree[2 * node], tree[2 * node + 1])
      node //= 2
  return bins


def bisect_bfd(sizes, cap):
  """Best fit, one item at a time, with a sorted list of (room, bin)."""
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  rooms, bins = [], []
  for i in order:
    s = sizes[i]
    j = bisect.bisect_left(rooms, (s, -1))
    if j < len(rooms):
      room, b = rooms.pop(j)
      bins[b].append(i)
    else:
      room, b = cap, len(bins)
      bins.append([i])
    bisect.insort(rooms, (room - s, b))
  return bins


def naive_rows(docs_per_row, seq_len):
  """Rows of the given documents back to back, then padding, as a naive loop: the four row
  features (labels = the next token inside the document, -100 at its end and on padding)."""
  b = len(docs_per_row)
  out = {k: np.zeros((b, seq_len), np.int32) for k in
         ("input_ids", "segment_ids", "segment_positions")}
  out["labels"] = np.full((b, seq_len), -100, np.int32)
  for r, docs in enumerate(docs_per_row):
    pos = 0
    for seg, doc in enumerate(docs, start=1):
      n = len(doc)
      out["input_ids"][r, pos:pos + n] = doc
      out["segment_ids"][r, pos:pos + n] = seg
      out["segment_positions"][r, pos:pos + n] = np.arange(n)
      out["labels"][r, pos:pos + n - 1] = doc[1:]
      pos += n
    assert pos <= seq_len
  return out

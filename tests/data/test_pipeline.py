"""Tests for segpack.pack_dataset against independent, naive oracles.

The oracles never use the plan or the row builder: they rebuild every document's expected chunks
directly from the contract (virtual sequence = [BOS] + tokens + [EOS], chunk c covers
[c * (seq_len - overlap), c * (seq_len - overlap) + seq_len)) and check every slot of every row
with plain Python loops.
"""

import collections
import os
import sys

import grain
import numpy as np
import pytest

import segpack
from segpack import shards
from support.masked_source import MaskedDocs
from segpack.data import packed as pipeline

BOS, EOS, PAD = 1, 2, 0
FEATURES = ("input_ids", "labels", "segment_ids", "segment_positions")


def make_docs(n, *, seed=0, max_len=40, min_len=1):
  """Random documents with tokens >= 3 (so BOS/EOS/PAD never occur inside a document)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 60000, size=int(rng.integers(min_len, max_len + 1))).astype(np.uint16)
          for _ in range(n)]


def expected_chunks(docs, seq_len, *, add_bos=True, add_eos=True, overlap=0, long_docs="split",
                    min_len=0):
  """The contract's chunks of every document, as tuples (naive, independent of the planner)."""
  out = []
  for doc in docs:
    if len(doc) < min_len:
      continue
    virtual = [BOS] * add_bos + [int(t) for t in doc] + [EOS] * add_eos
    stride = seq_len - overlap
    c = 0
    while True:
      chunk = virtual[c * stride:c * stride + seq_len]
      out.append(tuple(chunk))
      if c * stride + seq_len >= len(virtual) or long_docs == "truncate":
        break
      c += 1
  return out


def segments_of(row):
  """The token tuples of a row's segments, read slot by slot."""
  segs = collections.OrderedDict()
  for tok, seg in zip(row["input_ids"].tolist(), row["segment_ids"].tolist()):
    if seg:
      segs.setdefault(seg, []).append(tok)
  return [tuple(v) for v in segs.values()]


def check_row(row, seq_len, *, overlap=0, add_bos=True):
  """Checks the label/segment/position contract on every slot with a naive loop."""
  assert set(row) == set(FEATURES)
  for k in FEATURES:
    assert row[k].dtype == np.int32 and row[k].shape == (seq_len,), k
  ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
  seg, pos = row["segment_ids"].tolist(), row["segment_positions"].tolist()
  seg_start = {}
  prev = 0
  for i in range(seq_len):
    if seg[i] == 0:
      assert ids[i] == PAD and labels[i] == -100 and pos[i] == 0, i
      continue
    if seg[i] != prev:
      assert seg[i] == max([0] + list(seg_start)) + 1, (i, seg)  # 1..k in row order
      assert seg[i] not in seg_start
      seg_start[seg[i]] = i
    assert pos[i] == i - seg_start[seg[i]], (i, pos)
    prev = seg[i]
  for i in range(seq_len):
    same = i + 1 < seq_len and seg[i] != 0 and seg[i + 1] == seg[i]
    if same and overlap and not (add_bos and ids[seg_start[seg[i]]] == BOS):
      # A continuation chunk: targets at its slots 1..overlap-1 repeat the previous chunk.
      if i + 1 - seg_start[seg[i]] < overlap:
        same = False
    assert labels[i] == (ids[i + 1] if same else -100), (i, labels, ids, seg)


def epoch_rows(ds, epoch=0):
  n = ds.rows_in_epoch(0)
  return [ds[i] for i in range(epoch * n, (epoch + 1) * n)]


def rows_equal(a, b):
  return all(np.array_equal(a[k], b[k]) for k in FEATURES)


def row_key(row):
  return tuple(row["input_ids"].tolist()) + tuple(row["segment_ids"].tolist())


def pack(docs, *, add_bos=True, add_eos=True, bos_id=BOS, eos_id=EOS, pad_id=PAD,
         long_docs="split", overlap=0, min_len=0, max_segments_per_row=None, **kwargs):
  """`pack_dataset` with the tests' ids, the flat arguments put into their groups (with a
  segment cap, the packing settings as one `PlanOptions`, the cap's only spelling)."""
  special = segpack.SpecialTokens(add_bos=add_bos, add_eos=add_eos, bos_id=bos_id,
                                  eos_id=eos_id, pad_id=pad_id)
  long_docs = segpack.LongDocs(mode=long_docs, overlap=overlap, min_len=min_len)
  if max_segments_per_row is None:
    return segpack.pack_dataset(docs, special_tokens=special, long_docs=long_docs, **kwargs)
  plan = segpack.PlanOptions(seq_len=kwargs.pop("seq_len"),
                             strategy=kwargs.pop("strategy", "ffd"), long_docs=long_docs,
                             max_segments_per_row=max_segments_per_row)
  return segpack.pack_dataset(docs, plan=plan, special_tokens=special, **kwargs)


@pytest.mark.parametrize("strategy", ["ffd", "bfd", "greedy", "pad", "sorted_pad"])
@pytest.mark.parametrize("seq_len,overlap,add_bos,add_eos", [
    (16, 0, True, True), (32, 4, True, True), (24, 0, False, True), (64, 0, True, False),
    (16, 15, True, True)])
def test_every_token_once_in_order(strategy, seq_len, overlap, add_bos, add_eos):
  docs = make_docs(60, seed=seq_len, max_len=90)  # many documents longer than seq_len
  ds = pack(docs, seq_len=seq_len, strategy=strategy, overlap=overlap, add_bos=add_bos,
            add_eos=add_eos, num_epochs=1)
  assert isinstance(ds, grain.MapDataset)
  rows = list(ds)
  assert len(rows) == len(ds) == ds.rows_in_epoch(0)
  got = []
  for row in rows:
    check_row(row, seq_len, overlap=overlap, add_bos=add_bos)
    got.extend(segments_of(row))
  want = expected_chunks(docs, seq_len, add_bos=add_bos, add_eos=add_eos, overlap=overlap)
  assert sorted(got) == sorted(want)
  batched = ds.batch(7)  # the vectorized batch path builds the same rows as the per-row path
  for b in range(len(batched)):
    batch = batched[b]
    for n in range(batch["input_ids"].shape[0]):
      assert rows_equal({k: v[n] for k, v in batch.items()}, rows[b * 7 + n])


def test_truncate_and_min_len():
  docs = make_docs(40, seed=3, max_len=100)
  ds = pack(docs, seq_len=32, long_docs="truncate", min_len=5, num_epochs=1)
  got = [s for row in ds for s in segments_of(row)]
  for row in ds:
    check_row(row, 32)
  want = expected_chunks(docs, 32, long_docs="truncate", min_len=5)
  assert sorted(got) == sorted(want)
  assert any(len(d) + 2 > 32 for d in docs) and any(len(d) < 5 for d in docs)


def test_max_segments_per_row():
  docs = make_docs(200, seed=4, max_len=6)  # tiny documents: many segments per row
  free = pack(docs, seq_len=64, num_epochs=1, shuffle=False)
  assert max(int(r["segment_ids"].max()) for r in free) > 4
  ds = pack(docs, seq_len=64, num_epochs=1, max_segments_per_row=4)
  got = []
  for row in ds:
    check_row(row, 64)
    assert int(row["segment_ids"].max()) <= 4
    got.extend(segments_of(row))
  assert sorted(got) == sorted(expected_chunks(docs, 64))


def test_determinism_and_seeds():
  docs = make_docs(80, seed=5)
  a = epoch_rows(pack(docs, seq_len=32, seed=7))
  b = epoch_rows(pack(docs, seq_len=32, seed=7))
  c = epoch_rows(pack(docs, seq_len=32, seed=8))
  assert all(rows_equal(x, y) for x, y in zip(a, b))
  assert not all(rows_equal(x, y) for x, y in zip(a, c))
  assert sorted(map(row_key, a)) == sorted(map(row_key, c))  # same rows, other order
  plain = epoch_rows(pack(docs, seq_len=32, shuffle=False))
  assert sorted(map(row_key, a)) == sorted(map(row_key, plain))


def test_epochs_are_bounded_permutations():
  docs = make_docs(50, seed=6)
  ds = pack(docs, seq_len=32, num_epochs=3, seed=1)
  n = ds.rows_in_epoch(0)
  assert len(ds) == 3 * n
  epochs = [[row_key(ds[i]) for i in range(e * n, (e + 1) * n)] for e in range(3)]
  for e in range(3):
    assert sorted(epochs[e]) == sorted(epochs[0])  # each epoch: exactly the plan's rows
  assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # reshuffled every epoch
  assert [row_key(r) for r in ds] == epochs[0] + epochs[1] + epochs[2]
  infinite = pack(docs, seq_len=32, seed=1)
  assert len(infinite) == sys.maxsize
  assert row_key(infinite[2 * n + 3]) == epochs[2][3]


@pytest.mark.parametrize("count,batch", [(2, 4), (3, 6)])
def test_stream_batches_split_every_global_batch_over_processes(count, batch):
  """Process p's part of global batch k is its block of the next `batch` stream rows; over all
  processes every row of both epochs comes once, the last batch filled with padding rows
  (oracle: the dataset's own elements, read one by one)."""
  docs = make_docs(61, seed=count)
  whole = pack(docs, seq_len=32, seed=3, num_epochs=2)
  n = whole.rows_in_epoch(0)
  procs = [segpack.StreamBatches(whole, global_batch_size=batch, process_index=p,
                                 process_count=count) for p in range(count)]
  assert all(len(b) == -(-2 * n // batch) for b in procs)
  local = batch // count
  got = []
  for k in range(len(procs[0])):
    for p, batches in enumerate(procs):
      part = batches[k]
      assert part["input_ids"].shape == (local, 32)
      for j in range(local):
        t = k * batch + p * local + j
        row = {f: v[j] for f, v in part.items()}
        if t < 2 * n:
          assert rows_equal(row, whole[t])
          got.append(row_key(row))
        else:
          assert not row["segment_ids"].any() and (row["labels"] == -100).all()
  assert (2 * n) % batch  # the last batch has padding rows
  assert sorted(got) == sorted(row_key(whole[i]) for i in range(2 * n))


def test_batch_fast_path_equals_grain_batch():
  docs = make_docs(45, seed=9)
  ds = pack(docs, seq_len=32, num_epochs=2)
  fast = ds.batch(4)
  slow = grain.MapDataset.batch(ds, 4)
  assert len(fast) == len(slow)
  for i in range(len(fast) + 2):  # includes the short last batch and wrap-around
    a, b = fast[i], slow[i]
    assert all(np.array_equal(a[k], b[k]) for k in FEATURES)
    assert a["input_ids"].dtype == np.int32
  inf = pack(docs, seq_len=32)
  for i in (0, 5, 17):
    a, b = inf.batch(3)[i], grain.MapDataset.batch(inf, 3)[i]
    assert all(np.array_equal(a[k], b[k]) for k in FEATURES)
  assert len(ds.batch(4, drop_remainder=True)) == len(ds) // 4


def test_restore_at_every_step():
  docs = make_docs(40, seed=10)
  ds = pack(docs, seq_len=32, num_epochs=2, seed=4).batch(3).to_iter_dataset()
  it = iter(ds)
  states, batches = [], []
  for _ in range(12):
    states.append(it.get_state())
    batches.append(next(it))
  for k, state in enumerate(states):
    it2 = iter(ds)
    it2.set_state(state)
    for want in batches[k:k + 4]:
      got = next(it2)
      assert all(np.array_equal(got[f], want[f]) for f in FEATURES), k


def test_composes_with_mp_prefetch():
  from absl import flags  # grain's worker processes read absl flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  docs = make_docs(30, seed=11)
  ds = pack(docs, seq_len=32, num_epochs=1).batch(2)
  want = [ds[i] for i in range(len(ds))]
  got = list(ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert all(np.array_equal(a[f], b[f]) for f in FEATURES)


def test_grain_map_dataset_and_sharding_slices_as_source():
  docs = make_docs(30, seed=12)
  ds = pack(grain.MapDataset.source(docs), seq_len=32, num_epochs=1)
  got = sorted(s for row in ds for s in segments_of(row))
  assert got == sorted(expected_chunks(docs, 32))
  # Grain-style sharding of the element stream composes too (a strided slice).
  half = ds[1::2]
  assert len(half) == len(ds) // 2 and rows_equal(half[0], ds[1])


def test_shard_source_input(tmp_path):
  docs = make_docs(50, seed=13, max_len=80)
  path = tmp_path / "data"
  with shards.ShardWriter(str(path), vocab_size=65536, tokenizer_fingerprint="test") as w:
    for d in docs:
      w.write(d)
  for src in (str(path), shards.ShardSource(str(path))):
    ds = pack(src, seq_len=32, num_epochs=1, plan_cache_dir=str(tmp_path / "plans"))
    got = sorted(s for row in ds for s in segments_of(row))
    assert got == sorted(expected_chunks(docs, 32))


def test_bad_inputs():
  docs = make_docs(10)
  with pytest.raises(pipeline.PipelineConfigError, match="seq_len=2"):
    pack(docs, seq_len=2)
  with pytest.raises(ValueError, match="'fdd'.*ffd.*bfd.*greedy"):
    pack(docs, seq_len=32, strategy="fdd")
  with pytest.raises(pipeline.PipelineConfigError, match="no documents"):
    pack([], seq_len=32)
  with pytest.raises(ValueError, match="long_docs.mode must be one of split, truncate, got 'drop'"):
    pack(docs, seq_len=32, long_docs="drop")
  with pytest.raises(ValueError, match="bos_id"):
    pack(docs, seq_len=32, bos_id=None)
  with pytest.raises(ValueError, match="eos_id"):
    pack(docs, seq_len=32, eos_id=None)
  with pytest.raises(ValueError, match="overlap"):
    pack(docs, seq_len=32, overlap=32)
  with pytest.raises(ValueError, match="source\\[1\\]"):
    pack([np.arange(3), np.ones((2, 2), np.int32)], seq_len=32)
  with pytest.raises(ValueError, match="min_len"):
    pack(docs, seq_len=32, min_len=10**6)
  with pytest.raises(ValueError, match="seed"):
    pack(docs, seq_len=32, seed=-1)
  with pytest.raises(TypeError, match="shard_options"):  # StreamBatches splits over processes
    pack(docs, seq_len=32, shard_options=grain.sharding.ShardOptions(0, 2))
  for name in ("overlap", "min_len", "num_epochs", "max_segments_per_row"):
    with pytest.raises(pipeline.PipelineConfigError, match=f"{name} must .*got True"):
      pack(docs, seq_len=32, **{name: True})  # a bool is not taken for the int 1
  ok = pack(docs, seq_len=32, add_bos=False, add_eos=False, bos_id=None, eos_id=None)
  assert ok.rows_in_epoch(0) >= 1


def test_long_documents_each_mode():
  docs = [np.arange(3, 3 + n, dtype=np.uint32) for n in (5, 70, 31)]  # 70 + 2 > 2 * 32
  split = pack(docs, seq_len=32, long_docs="split", num_epochs=1, shuffle=False)
  assert sorted(s for r in split for s in segments_of(r)) == sorted(expected_chunks(docs, 32))
  trunc = pack(docs, seq_len=32, long_docs="truncate", num_epochs=1, shuffle=False)
  got = sorted(s for r in trunc for s in segments_of(r))
  assert got == sorted(expected_chunks(docs, 32, long_docs="truncate"))
  assert sum(len(s) for s in got) == 7 + 32 + 32


def write_shards(path, docs, **metadata):
  with shards.ShardWriter(str(path), vocab_size=65536, tokenizer_fingerprint="test",
                          shard_tokens=300, metadata=metadata) as w:
    for d in docs:
      w.write(d)
  return shards.ShardSource(str(path))


def test_plan_cache_beside_shards_and_capped_plan_cache(tmp_path, monkeypatch):
  from segpack import packing
  docs = make_docs(120, seed=14, max_len=20)
  src = write_shards(tmp_path / "data", docs)
  first = pack(src, seq_len=32, num_epochs=1, max_segments_per_row=2)
  assert os.path.isdir(tmp_path / "data" / "plans")
  assert any(name.endswith("-maxseg2") for name in os.listdir(tmp_path / "data" / "plans"))

  def boom(*args, **kwargs):
    raise AssertionError("replanned instead of loading the cache")

  monkeypatch.setattr(packing.planner, "plan", boom)
  monkeypatch.setattr(packing.cap, "cap_segments_per_row", boom)
  again = pack(src, seq_len=32, num_epochs=1, max_segments_per_row=2)
  assert len(again) == len(first)
  assert all(rows_equal(again[i], first[i]) for i in range(len(first)))
  assert all(int(r["segment_ids"].max()) <= 2 for r in again)
  plain = pack(src, seq_len=32, num_epochs=1)  # the uncapped plan was cached by the first call
  assert sorted(s for r in plain for s in segments_of(r)) == sorted(expected_chunks(docs, 32))


def test_special_ids_from_manifest_and_pickling(tmp_path):
  import pickle
  docs = make_docs(30, seed=15, max_len=50)
  src = write_shards(tmp_path / "data", docs, bos_id=BOS, eos_id=EOS)
  ds = segpack.pack_dataset(str(tmp_path / "data"), seq_len=32, num_epochs=1)
  assert sorted(s for r in ds for s in segments_of(r)) == sorted(expected_chunks(docs, 32))
  blob = pickle.dumps(ds)
  assert len(blob) < 20_000 + 16 * len(docs)  # plan arrays travel as file references
  clone = pickle.loads(blob)
  assert all(rows_equal(clone[i], ds[i]) for i in range(len(ds)))
  assert src.fingerprint


def test_restore_every_step_and_mp_prefetch_shards(tmp_path):
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  docs = make_docs(50, seed=16, max_len=60)
  write_shards(tmp_path / "data", docs)
  ds = pack(str(tmp_path / "data"), seq_len=32, num_epochs=2)
  iter_ds = ds.to_iter_dataset()
  it = iter(iter_ds)
  states, items = [], []
  for _ in range(len(ds)):  # crosses the epoch boundary
    states.append(it.get_state())
    items.append(next(it))
  for k in range(len(states)):
    it2 = iter(iter_ds)
    it2.set_state(states[k])
    assert all(rows_equal(next(it2), want) for want in items[k:k + 3]), k
  mp = ds.batch(4).to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
  want = [ds.batch(4)[i] for i in range(len(ds.batch(4)))]
  it = iter(mp)
  got = [next(it) for _ in range(3)]
  state = it.get_state()
  got += list(it)
  assert len(got) == len(want)
  assert all(all(np.array_equal(a[f], b[f]) for f in FEATURES) for a, b in zip(got, want))
  resumed = iter(mp)
  resumed.set_state(state)  # resume a multiprocess iterator mid-stream
  rest = list(resumed)
  assert len(rest) == len(want) - 3
  assert all(all(np.array_equal(a[f], b[f]) for f in FEATURES) for a, b in zip(rest, want[3:]))


# -----------------------------------------------------------------------------------------------
# The core promise, checked with tokens that name their document and position: token
# BASE + d * STRIDE + p is token p of document d, so every slot of every row can be traced back
# to (document, virtual slot) without the plan. On random documents and random packing
# parameters, no label points to a slot that is not the next virtual slot of the same document,
# and the set of trained targets is exactly the contract's (no -100 missing, none extra).

_BASE, _STRIDE = 16, 1 << 12


def _due_targets(lens, masks, *, seq_len, add_bos, add_eos, long_docs, overlap, min_len,
                 masked):
  """The (document, virtual slot) targets the contract trains, each once (naive)."""
  due = set()
  extra = add_bos + add_eos
  for d, n in enumerate(lens):
    slots = int(n) + extra
    if n < min_len or slots == 0:
      continue
    last = slots if long_docs == "split" else min(slots, seq_len)
    for v in range(1, last):
      if long_docs == "split" and overlap == 0 and v % seq_len == 0:
        continue  # first slot of a continuation chunk: nothing before it in its segment
      if masked:
        is_eos = add_eos and v == slots - 1
        if is_eos and (n == 0 or masks[d][n - 1] == 0):
          continue
        if not is_eos and masks[d][v - add_bos] == 0:
          continue
      due.add((d, v))
  return due


def _trace_segment(toks, lens, *, add_bos):
  """(document, first virtual slot) of a segment's tokens, or (None, None) for a segment with
  no document token (BOS/EOS of an empty document, or a lone EOS chunk)."""
  real = toks >= _BASE
  docs = set(((toks[real] - _BASE) // _STRIDE).tolist())
  assert len(docs) <= 1, f"a segment mixes documents {docs}"
  if not docs:
    return None, None
  d = docs.pop()
  first = int(np.argmax(real))
  v0 = int(toks[first]) - _BASE - d * _STRIDE + add_bos - first
  for j, t in enumerate(toks.tolist()):  # consecutive virtual slots of document d
    v = v0 + j
    want = BOS if add_bos and v == 0 else (
        EOS if v == int(lens[d]) + add_bos else _BASE + d * _STRIDE + v - add_bos)
    assert t == want, (d, v, t, want)
  return d, v0


def _random_packing_case(seed):
  rng = np.random.default_rng(seed)
  lens = rng.integers(0 if rng.random() < 0.3 else 1, int(rng.choice([5, 20, 80, 300])) + 1,
                      size=int(rng.integers(1, 50)))
  docs = [(_BASE + d * _STRIDE + np.arange(n)).astype(np.int32) for d, n in enumerate(lens)]
  masks = [rng.integers(0, 2, size=n).astype(np.uint8) for n in lens]
  add_bos, add_eos = bool(rng.integers(2)), bool(rng.integers(2))
  seq_len = int(rng.integers(add_bos + add_eos + 1, 64))
  params = dict(
      seq_len=seq_len, strategy=str(rng.choice(["ffd", "bfd", "greedy", "pad", "sorted_pad"])),
      long_docs=str(rng.choice(["split", "truncate"])),
      overlap=int(rng.integers(0, seq_len)) if rng.random() < 0.5 else 0,
      min_len=int(rng.integers(0, 4)) if rng.random() < 0.3 else 0,
      add_bos=add_bos, add_eos=add_eos, seed=seed, shuffle=bool(rng.integers(2)))
  cap = int(rng.integers(1, 5)) if rng.random() < 0.3 else None
  masked = bool(rng.random() < 0.25)
  return lens, docs, masks, params, cap, masked


@pytest.mark.parametrize("block", range(4))
def test_no_label_crosses_segments_and_every_due_target_is_trained_once(block):
  for seed in range(block * 40, (block + 1) * 40):
    lens, docs, masks, params, cap, masked = _random_packing_case(seed)
    source = MaskedDocs(docs, masks) if masked else docs
    if not any(n >= params["min_len"] and n + params["add_bos"] + params["add_eos"] > 0
               for n in lens):
      continue
    ds = pack(source, num_epochs=1, max_segments_per_row=cap, **params)
    batch = ds.get_batch(np.arange(len(ds)))
    add_bos = params["add_bos"]
    trained, anonymous = [], 0
    for r in range(len(ds)):
      row = {k: v[r] for k, v in batch.items()}
      assert rows_equal(row, ds[r]), (seed, r)  # the one-row path agrees with the batch path
      ids, labels, seg = row["input_ids"], row["labels"], row["segment_ids"]
      if cap is not None:
        assert int(seg.max()) <= cap
      used = int((seg > 0).sum())
      assert (seg[:used] > 0).all() and (labels[used:] == -100).all() and (ids[used:] == PAD).all()
      for s in range(1, int(seg.max()) + 1):
        idx = np.flatnonzero(seg == s)
        assert np.array_equal(idx, idx[0] + np.arange(idx.size)), (seed, r, s)
        assert np.array_equal(row["segment_positions"][idx], np.arange(idx.size))
        d, v0 = _trace_segment(ids[idx], lens, add_bos=add_bos)
        for j in np.flatnonzero(labels[idx] != -100).tolist():
          assert j + 1 < idx.size, f"seed {seed}: a label crosses the end of segment {s}"
          assert labels[idx[j]] == ids[idx[j + 1]]
          if d is None:
            anonymous += 1
          else:
            trained.append((d, v0 + j + 1))
    due = _due_targets(lens, masks, masked=masked, **{
        k: params[k] for k in ("seq_len", "add_bos", "add_eos", "long_docs", "overlap",
                               "min_len")})
    empty = {d for d, n in enumerate(lens) if n == 0}
    assert len(trained) == len(set(trained)), f"seed {seed}: a target is trained twice"
    assert set(trained) == {t for t in due if t[0] not in empty}, (seed, params, cap, masked)
    assert anonymous == len([t for t in due if t[0] in empty]), (seed, params)


def test_empty_document_with_loss_mask_and_eos():
  docs = [np.array([], np.int32), np.array([20, 21], np.int32)]
  masks = [np.zeros(0, np.uint8), np.array([1, 1], np.uint8)]
  ds = pack(MaskedDocs(docs, masks), seq_len=8, num_epochs=1, shuffle=False, strategy="greedy")
  row = ds[0]
  # [BOS EOS] of the empty document trains nothing; the other document trains 20, 21 and EOS.
  assert row["input_ids"].tolist() == [BOS, EOS, BOS, 20, 21, EOS, PAD, PAD]
  assert row["labels"].tolist() == [-100, -100, 20, 21, EOS, -100, -100, -100]
  assert rows_equal(row, {k: v[0] for k, v in ds.get_batch([0]).items()})

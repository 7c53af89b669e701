"""Loss masks through packing, and minibatch packing (`pack_dataset`, `pack_minibatches`).

Oracles: every token id encodes its (conversation, position), so the rows alone tell which
(conversation, input slot, target slot) pairs carry loss; the expected pairs come from a naive
per-conversation walk over the documented virtual sequence [BOS, tokens..., EOS]. Minibatches are
checked against the documented permutation recipe (what unpacked sampling draws).
"""

import collections
import math

import grain
import numpy as np
import pytest

from support.masked_source import MaskedDocs
from segpack import packing
from segpack.data import packed as pipeline
from segpack.data.minibatch_dataset import pack_minibatches
from segpack.data.options import SpecialTokens
from segpack.packing import LongDocs
from segpack import shards

BOS, EOS = 1, 2
ONE = dict(process_index=0, process_count=1)  # every row of each step, here
IDS = SpecialTokens(bos_id=BOS, eos_id=EOS)
STRIDE = 10_000


def _token(conv, pos):
  return 10 + conv * STRIDE + pos


def _decode(token):
  return (token - 10) // STRIDE, (token - 10) % STRIDE


def make_source(tmp_path, num=40, seed=0, max_len=30):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, max_len, size=num)
  lengths[3] = 3 * max_len  # some conversations are much longer than a row
  masks = []
  with shards.ShardWriter(tmp_path / "ds", vocab_size=2**20, tokenizer_fingerprint="t",
                          shard_tokens=200, loss_mask=True,
                          metadata={"tokenizer": {"bos_id": BOS, "eos_id": EOS}}) as w:
    for c, n in enumerate(lengths.tolist()):
      # Runs of trained / untrained tokens, as turns.
      mask = (np.cumsum(rng.random(n) < 0.3) % 2).astype(np.uint8)
      masks.append(mask)
      w.write(np.asarray([_token(c, p) for p in range(n)], np.uint32), loss_mask=mask)
  return shards.ShardSource(tmp_path / "ds"), masks


def naive_pairs(masks, seq_len, overlap):
  """Expected (conversation, input virtual slot, target virtual slot) pairs with loss."""
  out = collections.Counter()
  for c, mask in enumerate(masks):
    n = len(mask)
    vmask = np.concatenate([[0], mask, [mask[-1]]])  # BOS, tokens, EOS (follows the last token)
    for j in range(n + 1):
      if not vmask[j + 1]:
        continue
      if overlap == 0 and n + 2 > seq_len and j // seq_len != (j + 1) // seq_len:
        continue  # the pair straddles a chunk boundary
      out[(c, j, j + 1)] += 1
  return out


def row_pairs(rows_iter):
  """The pairs that carry loss in the rows, read from tokens and labels only."""
  out = collections.Counter()
  for row in rows_iter:
    ids, labels = row["input_ids"], row["labels"]
    for i in np.flatnonzero(labels != -100).tolist():
      x, y = int(ids[i]), int(labels[i])
      if x == BOS:
        c, p = _decode(y)
        out[(c, 0, p + 1)] += 1
      elif y == EOS:
        c, p = _decode(x)
        out[(c, p + 1, p + 2)] += 1
      else:
        (c, p), (c2, q) = _decode(x), _decode(y)
        assert c == c2, "a label crosses conversations"
        out[(c, p + 1, q + 1)] += 1
  return out


def _rows_of(ds):
  for i in range(len(ds)):
    batch = ds[i]
    if batch["input_ids"].ndim == 1:
      yield batch
    else:
      for r in range(batch["input_ids"].shape[0]):
        yield {k: v[r] for k, v in batch.items()}


@pytest.mark.parametrize("strategy, overlap", [("ffd", 0), ("ffd", 3), ("greedy", 0)])
def test_global_packing_trains_exactly_the_masked_pairs(tmp_path, strategy, overlap):
  src, masks = make_source(tmp_path)
  ds = pipeline.pack_dataset(src, seq_len=16, strategy=strategy,
                             long_docs=LongDocs(overlap=overlap), num_epochs=1,
                             plan_cache_dir=tmp_path / "plans")
  assert row_pairs(_rows_of(ds)) == naive_pairs(masks, 16, overlap)
  # The batched (vectorized) path agrees with the per-row path.
  batch = ds.get_batch(np.arange(len(ds)))
  for r, row in enumerate(_rows_of(ds)):
    assert (batch["labels"][r] == row["labels"]).all()


def test_mask_can_be_ignored_and_sequence_sources_work(tmp_path):
  src, masks = make_source(tmp_path, num=10)
  full = pipeline.pack_dataset(src, seq_len=16, num_epochs=1,
                               loss_mask=False, plan_cache_dir=tmp_path / "p")
  every = [np.ones_like(m) for m in masks]
  assert row_pairs(_rows_of(full)) == naive_pairs(every, 16, 0)


  listed = MaskedDocs([np.asarray(src[i]) for i in range(len(src))], masks)
  ds = pack_minibatches(listed, seq_len=16, num_epochs=1, **ONE,
                        special_tokens=IDS, examples_per_batch=3)
  assert row_pairs(_rows_of(ds)) == naive_pairs(masks, 16, 0)
  with pytest.raises(pipeline.PipelineConfigError, match="has no loss mask"):
    pipeline.pack_dataset([np.arange(3, 9)], seq_len=16, special_tokens=IDS, loss_mask=True)


@pytest.mark.parametrize("k, drop", [(4, False), (7, False), (7, True)])
def test_minibatch_mode_draws_the_unpacked_minibatches(tmp_path, k, drop):
  src, masks = make_source(tmp_path)
  n, seed, epochs = len(src), 5, 2
  ds = pack_minibatches(src, seq_len=16, examples_per_batch=k, seed=seed, num_epochs=epochs,
                        drop_remainder=drop, **ONE)
  # Unpacked training: the same examples, batched by k, takes this many steps per epoch.
  unpacked = grain.MapDataset.range(n).batch(k, drop_remainder=drop)
  assert len(ds) == epochs * len(unpacked) == epochs * (n // k if drop else math.ceil(n / k))
  step = 0
  for epoch in range(epochs):
    perm = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(n)
    for b in range(len(unpacked)):
      batch = ds[step]
      assert batch["input_ids"].shape == (ds.rows_per_batch, 16)
      seen = {_decode(int(t))[0] for t in batch["input_ids"].reshape(-1) if t > EOS}
      assert seen == set(perm[b * k:(b + 1) * k].tolist())
      step += 1
  # Over one epoch, every trained pair of every conversation, exactly once.
  one = pack_minibatches(src, seq_len=16, examples_per_batch=k, seed=seed, num_epochs=1,
                         **ONE)
  if not drop:
    assert row_pairs(_rows_of(one)) == naive_pairs(masks, 16, 0)


def test_minibatch_rows_are_fewer_than_padding_and_static(tmp_path):
  src, _ = make_source(tmp_path)
  kw = dict(seq_len=16, examples_per_batch=8, num_epochs=3, **ONE)
  packed = pack_minibatches(src, strategy="ffd", **kw)
  padded = pack_minibatches(src, strategy="pad", **kw)
  assert len(packed) == len(padded)
  assert packed.rows_per_batch < padded.rows_per_batch
  assert packed.padded_slot_fraction(0) < padded.padded_slot_fraction(0)
  # Each minibatch takes as many rows as the library's FFD planner needs for its examples alone.
  plan0 = packed.plan(0)
  for b in range(plan0.num_batches):
    members = plan0.examples[plan0.batch_examples[b]:plan0.batch_examples[b + 1]]
    want = packing.plan(src.lengths[members], 16, strategy="ffd", extra_tokens=2).num_rows
    assert plan0.rows_needed[b] == want
  # rows_per_batch is the most any batch of the 3 epochs needs.
  need = max(int(packed.plan(e).rows_needed.max()) for e in range(3))
  assert packed.rows_per_batch == need
  with pytest.raises(pipeline.PipelineConfigError,
                     match=r"epoch \d batch \d+ needs \d+ rows but rows_per_batch=1"):
    pack_minibatches(src, rows_per_batch=1, **kw)
  # Infinite: a static bound that every batch fits.
  inf = pack_minibatches(src, seq_len=16, examples_per_batch=8, **ONE)
  assert inf.rows_per_batch >= need and inf[10 * len(packed)]["input_ids"].shape[0] >= need


def test_no_conversation_is_split_unless_longer_than_a_row(tmp_path):
  src, masks = make_source(tmp_path)
  for pack, kw in ((pack_minibatches, dict(examples_per_batch=6, **ONE)),
                   (pack_minibatches, dict(tokens_per_batch=96, **ONE)),
                   (pipeline.pack_dataset, dict(strategy="ffd"))):
    ds = pack(src, seq_len=16, num_epochs=1, **kw)
    segments = collections.Counter()
    for row in _rows_of(ds):
      for s in set(row["segment_ids"].tolist()) - {0}:
        tokens = row["input_ids"][row["segment_ids"] == s]
        convs = {_decode(int(t))[0] for t in tokens if t > EOS}
        assert len(convs) <= 1
        if convs:  # (a last chunk may hold only the EOS)
          segments[convs.pop()] += 1
    for c, mask in enumerate(masks):
      # Virtual slots 1..n are the tokens: the chunks of 16 slots that hold any of them.
      assert segments[c] == len(mask) // 16 + 1, c


def test_token_budget_batches(tmp_path):
  src, masks = make_source(tmp_path)
  seed = 3
  ds = pack_minibatches(src, seq_len=16, tokens_per_batch=96, seed=seed, num_epochs=1,
                        **ONE)
  assert ds.rows_per_batch == 6
  perm = np.random.default_rng(np.random.SeedSequence([seed, 0])).permutation(len(src))
  order = []
  for i in range(len(ds)):
    batch = ds[i]
    assert batch["input_ids"].shape == (6, 16)
    assert int((batch["segment_ids"] > 0).sum()) <= 96
    first_seen = []
    for t in batch["input_ids"].reshape(-1).tolist():
      if t > EOS and _decode(t)[0] not in first_seen:
        first_seen.append(_decode(t)[0])
    members = sorted(first_seen, key=lambda c: list(perm).index(c))
    order += members
  # Batches are consecutive runs of the sampling order, every example exactly once.
  assert order == perm.tolist()
  assert row_pairs(_rows_of(ds)) == naive_pairs(masks, 16, 0)
  with pytest.raises(pipeline.PipelineConfigError, match="tokens_per_batch=8 is less than seq_len"):
    pack_minibatches(src, seq_len=16, tokens_per_batch=8, num_epochs=1, **ONE)
  with pytest.raises(pipeline.PipelineConfigError, match="document 3 needs 6 rows"):
    pack_minibatches(src, seq_len=16, tokens_per_batch=32, num_epochs=1, **ONE,
                     shuffle=False)


def test_minibatch_processes_split_each_batch(tmp_path):
  """Process p of 2 holds the contiguous block [p*R/2, (p+1)*R/2) of every step's rows."""
  src, _ = make_source(tmp_path)
  kw = dict(seq_len=16, examples_per_batch=8, num_epochs=1)
  parts = [pack_minibatches(src, process_index=p, process_count=2, **kw) for p in range(2)]
  rows = parts[0].rows_per_batch
  assert rows % 2 == 0 and parts[1].rows_per_batch == rows
  whole = pack_minibatches(src, **ONE, rows_per_batch=rows, **kw)
  for i in range(len(whole)):
    a, b = parts[0][i]["input_ids"], parts[1][i]["input_ids"]
    assert a.shape == b.shape == (rows // 2, 16)
    assert (np.concatenate([a, b]) == whole[i]["input_ids"]).all()


@pytest.mark.parametrize("kw, error, match", [
    (dict(), pipeline.PipelineConfigError,
     "exactly one of examples_per_batch and tokens_per_batch"),
    (dict(examples_per_batch=2, tokens_per_batch=64), pipeline.PipelineConfigError,
     "exactly one of"),
    (dict(examples_per_batch=0), pipeline.PipelineConfigError,
     "examples_per_batch must be None or an int >= 1, got 0"),
    (dict(examples_per_batch=2, drop_remainder="yes"), pipeline.PipelineConfigError,
     "drop_remainder must be a bool, got 'yes'"),
    (dict(examples_per_batch=2, max_segments_per_row=2), TypeError, "max_segments_per_row"),
])
def test_minibatch_bad_arguments(tmp_path, kw, error, match):
  src, _ = make_source(tmp_path, num=5)
  with pytest.raises(error, match=match):
    pack_minibatches(src, seq_len=16, **ONE, **kw)


def test_minibatch_dataset_resumes_and_pickles(tmp_path):
  import pickle  # pylint: disable=g-import-not-at-top

  src, _ = make_source(tmp_path)
  ds = pack_minibatches(src, seq_len=16, examples_per_batch=6, **ONE)  # infinite
  it = ds.to_iter_dataset().__iter__()
  for _ in range(9):  # into the second epoch (7 batches per epoch)
    next(it)
  state = it.get_state()
  want = [next(it)["input_ids"] for _ in range(4)]
  again = pickle.loads(pickle.dumps(ds)).to_iter_dataset().__iter__()
  again.set_state(state)
  for w in want:
    assert (next(again)["input_ids"] == w).all()
  assert ds.locate(9) == (1, 2) and ds.batches_in_epoch(1) == 7

"""Weighted mixtures (`segpack.Mixture`): weights are shares of trained tokens.

Oracles: every token names its source and document (BASE + s * STRIDE + d), so the rows say
which documents they hold without the pipeline; the draw written out naively from the
documented rule (seeded permutations, fresh ones when a source must repeat, whole documents up
to the target); and, for resuming, every (epoch, plan row) counted over all processes.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import segpack
from segpack import shards
from segpack.data.mixture import Mixture, MixtureDraws, MixtureSource
from segpack.data.stream import StreamBatches
from train import data as data_lib
from train.model import config as model_config
from train.model import decoder as model_lib
from train import steps as steps_lib
from train.objective import TokenObjective
from support import data_configs  # noqa: E402

BASE, STRIDE, BOS, EOS = 16, 1 << 12, 1, 2
SEQ_LEN = 48


def named_docs(s, n, *, low, high, seed):
  rng = np.random.default_rng(seed)
  return [np.full(int(k), BASE + s * STRIDE + d, np.int32)
          for d, k in enumerate(rng.integers(low, high, size=n))]


SOURCES = [named_docs(0, 80, low=1, high=20, seed=0),  # short documents
           named_docs(1, 30, low=20, high=90, seed=1),  # long ones (split across rows)
           named_docs(2, 6, low=5, high=15, seed=2)]  # tiny: must repeat
WEIGHTS = [0.5, 0.3, 0.2]


def mixture(tokens_per_epoch=None):
  return Mixture(sources=tuple(MixtureSource(name=f"s{i}", source=docs, weight=w)
                               for i, (docs, w) in enumerate(zip(SOURCES, WEIGHTS))),
                 tokens_per_epoch=tokens_per_epoch)


def naive_draw(seed, epoch, source, lengths, target):
  """The documented rule, one document at a time."""
  drawn, total, cycle = [], 0, 0
  while total < target:
    perm = np.random.default_rng([seed, epoch, source, cycle]).permutation(len(lengths))
    for d in perm.tolist():
      if total >= target:
        break
      drawn.append(d)
      total += int(lengths[d])
    cycle += 1
  return collections.Counter(drawn)


def pack(num_epochs=3, **kw):
  return segpack.pack_dataset(mixture(**kw), seq_len=SEQ_LEN, seed=7, num_epochs=num_epochs,
                              special_tokens=segpack.SpecialTokens(bos_id=BOS, eos_id=EOS))


@pytest.mark.parametrize("tokens_per_epoch", [None, 3_000])
def test_every_drawn_document_once_per_draw_with_the_token_shares(tokens_per_epoch):
  ds = pack(tokens_per_epoch=tokens_per_epoch)
  total = sum(int(sum(map(len, docs))) for docs in SOURCES)
  budget = total if tokens_per_epoch is None else tokens_per_epoch
  for epoch in range(3):
    start, rows = ds.epoch_start(epoch), ds.rows_in_epoch(epoch)
    batch = ds.get_batch(np.arange(start, start + rows))
    ids = batch["input_ids"][(batch["segment_ids"] > 0) & (batch["input_ids"] >= BASE)]
    seen = collections.Counter(ids.tolist())  # token value -> slots
    for s, docs in enumerate(SOURCES):
      want = naive_draw(7, epoch, s, [len(d) for d in docs], WEIGHTS[s] * budget)
      for d, doc in enumerate(docs):  # every token of every drawn copy in exactly one slot
        assert seen.get(BASE + s * STRIDE + d, 0) == want.get(d, 0) * len(doc), (epoch, s, d)
      got = sum(want[d] * len(docs[d]) for d in want)
      assert 0 <= got - WEIGHTS[s] * budget < max(map(len, docs)), (epoch, s)  # one document
      counts = [want.get(d, 0) for d in range(len(docs))]
      assert max(counts) - min(counts) <= 1, (epoch, s)  # repetition counts
  draws = [MixtureDraws(mixture(tokens_per_epoch), seed=7).draw(e) for e in range(2)]
  assert not np.array_equal(draws[0].documents.parent_ids, draws[1].documents.parent_ids)
  assert draws[0].max_repeats[2] >= 2  # the tiny source repeats


def test_rows_differ_per_epoch_and_batches_cross_epochs_exactly():
  ds = pack(num_epochs=None)
  counts = [ds.rows_in_epoch(e) for e in range(4)]
  assert ds.rows_in_epoch(0) == counts[0] and ds.epoch_start(3) == sum(counts[:3])
  epoch, index = ds.locate(np.array([counts[0] - 1, counts[0], counts[0] + counts[1]]))
  assert epoch.tolist() == [0, 1, 2] and index.tolist() == [counts[0] - 1, 0, 0]
  whole = ds.get_batch(np.arange(counts[0] - 3, counts[0] + 3))  # straddles the boundary
  for n, i in enumerate(range(counts[0] - 3, counts[0] + 3)):
    assert np.array_equal(whole["input_ids"][n], ds[i]["input_ids"])


def test_resume_across_a_mixture_epoch_boundary_on_fewer_processes():
  """2 processes read into epoch 1, then 1 process goes on from the saved position: every row
  of epochs 0..2 is read exactly once (rows per epoch from the dataset, which differ)."""
  ds = pack(num_epochs=None)
  counts = [ds.rows_in_epoch(e) for e in range(3)]
  read = collections.Counter()

  def consume(iterators, steps):
    for _ in range(steps):
      for it in iterators:
        next(it)
        epochs, rows = it.last_plan_rows
        read.update(zip(epochs.tolist(), rows.tolist()))

  two = [StreamBatches(ds, global_batch_size=8, process_index=p, process_count=2).iterator()
         for p in range(2)]
  steps1 = counts[0] // 8 + 2
  consume(two, steps1)
  state = two[0].get_state()
  assert state == two[1].get_state() and state["epoch"] == 1
  one = StreamBatches(pack(num_epochs=None), global_batch_size=6, process_index=0,
                      process_count=1).iterator()
  one.set_state(state)
  consume([one], -(-(sum(counts) - steps1 * 8) // 6))
  for e in range(3):
    assert [read[e, r] for r in range(counts[e])] == [1] * counts[e], e
  assert all(c == 1 for c in read.values())


@pytest.mark.parametrize("spec, match", [
    ("a=x:0.5,a=y:0.5", "name 'a' is used twice"),
    ("a=x:0,b=y:1", "'a' needs a positive weight, got 0.0"),
    ("a=x:-1", "'a' needs a positive weight"),
    ("a=x:heavy", "the weight 'heavy' is not a number"),
])
def test_bad_mixture_entries_are_named(spec, match, tmp_path):
  with pytest.raises(segpack.PipelineConfigError, match=match):
    segpack.pack_dataset(Mixture.parse(spec.replace("x", str(tmp_path / "x"))), seq_len=16)


def test_mixture_sources_must_share_a_tokenizer_and_exist(tmp_path):
  for name, fingerprint in (("a", "one"), ("b", "two")):
    with shards.ShardWriter(str(tmp_path / name), vocab_size=100,
                            tokenizer_fingerprint=fingerprint) as w:
      w.write(np.arange(3, 9))
  with pytest.raises(segpack.PipelineConfigError, match="'a' .*one.* and 'b' .*two"):
    segpack.pack_dataset(Mixture.parse(f"a={tmp_path / 'a'}:1,b={tmp_path / 'b'}:1"),
                         seq_len=16, special_tokens=segpack.SpecialTokens(bos_id=1, eos_id=2))
  with pytest.raises(segpack.PipelineConfigError, match="mixture source 'c'"):
    segpack.pack_dataset(Mixture.parse(f"a={tmp_path / 'a'}:1,c={tmp_path / 'missing'}:1"),
                         seq_len=16)
  with pytest.raises(segpack.PipelineConfigError, match="mixture source 'e' .* is empty"):
    segpack.pack_dataset(Mixture(sources=(MixtureSource(name="e", source=[], weight=1.0),)),
                         seq_len=16)


def test_parse_spelling():
  m = Mixture.parse("web=data/web:0.7, code=data/code:0.3")
  assert [(s.name, s.source, s.weight) for s in m.sources] == [
      ("web", "data/web", 0.7), ("code", "data/code", 0.3)]
  plain = Mixture.parse("data/mine")
  assert [(s.name, s.source, s.weight) for s in plain.sources] == [("mine", "data/mine", 1.0)]


def test_trainer_mixture_keeps_every_source_held_out_apart(tmp_path):
  for s, docs in enumerate(SOURCES[:2]):
    with shards.ShardWriter(str(tmp_path / f"s{s}"), vocab_size=BASE + 2 * STRIDE,
                            tokenizer_fingerprint="named",
                            metadata={"tokenizer": {"bos_id": BOS, "eos_id": EOS}}) as w:
      for doc in docs:
        w.write(doc)
  spec = data_configs.builtin_data_config(
      seq_len=SEQ_LEN, eval_share=0.2, train=f"a={tmp_path / 's0'}:0.6,b={tmp_path / 's1'}:0.4")
  data = data_lib.make_data(spec, batch_size=4, process_index=0, process_count=1)

  def docs_in(batches):
    found = set()
    for b in batches:
      ids = b["input_ids"][(b["segment_ids"] > 0) & (b["input_ids"] >= BASE)]
      found |= set(ids.tolist())
    return found

  trained = docs_in(data.train[k] for k in range(3 * data.train_rows_in_epoch0 // 4))
  held = docs_in(data.eval[k] for k in range(len(data.eval)))
  assert held and trained and not trained & held
  assert {t // STRIDE for t in held - {BASE}} >= {0} and any(t >= BASE + STRIDE for t in held)
  assert data.vocab_size == BASE + 2 * STRIDE


def test_per_source_loss_equals_a_per_source_recomputation():
  """The train step's per-source sums (over 2 micro-batches) equal each source's token
  cross-entropy computed on its own from the same logits in float64."""
  small = Mixture(sources=tuple(MixtureSource(name=f"s{i}", source=[d % 97 + 3 for d in docs],
                                              weight=w)
                                for i, (docs, w) in enumerate(zip(SOURCES, WEIGHTS))),
                  segment_sources=True)
  ds = segpack.pack_dataset(small, seq_len=SEQ_LEN, num_epochs=1, seed=3,
                            special_tokens=segpack.SpecialTokens(bos_id=BOS, eos_id=EOS))
  batch = {k: jnp.asarray(v) for k, v in ds.get_batch(np.arange(8)).items()}
  sources = np.asarray(batch["segment_sources"])
  assert set(np.unique(sources).tolist()) >= {0, 1}
  cfg = model_config.DecoderConfig(vocab_size=100, num_layers=1, d_model=32, num_heads=4,
                                num_kv_heads=2, head_dim=8, d_ff=48, init_std=0.2,
                                attention_implementation="xla", dtype="float32")
  graphdef, params = nnx.split(model_lib.Decoder(cfg, rngs=nnx.Rngs(params=0)))
  tx, schedule = optax.sgd(0.0), optax.constant_schedule(0.0)
  state = dict(params=params, opt_state=tx.init(params), step=jnp.int32(0))
  step = steps_lib.make_train_step(graphdef, tx, schedule, accum=2,
                                   objective=TokenObjective(source_names=("a", "b", "c")))
  _, metrics = jax.jit(step)(state, batch)
  forward = jax.jit(lambda p, b: nnx.merge(graphdef, p)(  # one program, not op by op
      b["input_ids"], segment_ids=b["segment_ids"], segment_positions=b["segment_positions"]))
  logits = np.asarray(forward(params, batch), np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  labels = np.asarray(batch["labels"])
  for n in range(3):
    keep = (labels != -100) & (sources == n)
    want = -sum(logp[b, s, labels[b, s]] for b, s in zip(*np.nonzero(keep)))
    assert float(metrics["source_tokens"][n]) == keep.sum()
    np.testing.assert_allclose(float(metrics["source_loss_sum"][n]), want, rtol=1e-4, atol=1e-4)
  assert float(metrics["source_tokens"].sum()) == float(metrics["trained_tokens"])

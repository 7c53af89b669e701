"""One process split and one iterator state for both batch streams.

The streams: global batches of the row stream (`StreamBatches` over `pack_dataset`, unit "rows")
and packed minibatch steps (`pack_minibatches`, unit "steps"). For both, process `p` of `Q` owns
the contiguous block `[p*B/Q, (p+1)*B/Q)` of every global batch of `B` rows, so the processes'
parts, concatenated in process order, are the global batch in order; and the iterator state is
`{"version": 1, "unit", "epoch", "index", "epoch_length"}`, the same on every process.

Oracles: the global batch of the row stream is the stream's own elements read one by one
(`pack_dataset(...)[t]`); that of a minibatch step is the one-process dataset's element; the
expected positions come from the plan's row count (`segpack.packing.plan`) and the step count
of unpacked sampling (`ceil(N / examples_per_batch)`), computed here.
"""

import collections
import json
import math

import numpy as np
import pytest

import segpack
from segpack import packing
from segpack.data.position import STATE_KEYS, StreamIterator, StreamStateError
from train import checkpoint_compat as ckpt_compat
from train import data as data_lib
from support import data_configs  # noqa: E402

SEQ_LEN, SEED, BOS, EOS = 64, 3, 1, 2
IDS = segpack.SpecialTokens(bos_id=BOS, eos_id=EOS)
BATCH = 8  # global rows per step, both streams
EXAMPLES = 6  # examples per minibatch step
FEATURES = ("input_ids", "labels", "segment_ids", "segment_positions")


def make_docs(n=90, seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.clip(np.round(rng.lognormal(2.8, 0.9, size=n)), 1, 60).astype(np.int64)
  return [rng.integers(3, 1000, size=int(k), dtype=np.int32) for k in lengths]


def row_stream(docs):
  return segpack.pack_dataset(docs, seq_len=SEQ_LEN, seed=SEED, num_epochs=None,
                              special_tokens=IDS)


def build(stream, docs, *, process_index, process_count, rows=BATCH):
  """Process `process_index` of `process_count`'s batches of `stream` ("rows" or "steps")."""
  if stream == "rows":
    return segpack.StreamBatches(row_stream(docs), global_batch_size=rows,
                                 process_index=process_index, process_count=process_count)
  return segpack.pack_minibatches(docs, seq_len=SEQ_LEN, examples_per_batch=EXAMPLES,
                                  rows_per_batch=rows, seed=SEED, special_tokens=IDS,
                                  process_index=process_index, process_count=process_count)


def joined(parts):
  """The processes' parts of one global batch, concatenated in process order."""
  return {f: np.concatenate([part[f] for part in parts]) for f in FEATURES}


def assert_batch(got, want, *, label):
  """`got` is `want` in order, then (a batch rounded up for the processes) padding rows."""
  n = len(want["input_ids"])
  for f in FEATURES:
    np.testing.assert_array_equal(got[f][:n], want[f], err_msg=f"{label}: {f}")
  assert not got["segment_ids"][n:].any() and (got["labels"][n:] == -100).all(), label


def global_batch(stream, docs, k, *, rows=BATCH):
  """The oracle: global batch `k` over all processes."""
  if stream == "rows":
    whole = row_stream(docs)
    return {f: np.stack([whole[t][f] for t in range(k * rows, (k + 1) * rows)]) for f in FEATURES}
  return build("steps", docs, process_index=0, process_count=1, rows=rows)[k]


@pytest.mark.parametrize("stream,count", [
    ("rows", 1), ("rows", 2), ("rows", 4),
    ("steps", 1), ("steps", 2), ("steps", 4),
    ("steps", 3),  # 8 rows a step, rounded up to 9: each process 3, the last row padding
])
def test_the_processes_blocks_in_order_are_the_global_batch(stream, count):
  docs = make_docs()
  parts = [build(stream, docs, process_index=p, process_count=count) for p in range(count)]
  local = -(-BATCH // count)
  for k in (0, 3, 17):  # step 17: epoch 1 of both streams
    got = [part[k] for part in parts]
    assert all(g["input_ids"].shape == (local, SEQ_LEN) for g in got)
    assert_batch(joined(got), global_batch(stream, docs, k), label=f"{stream} {count} {k}")
  if stream == "rows":  # the rows of an element, as `process_block` gives them
    assert [part.local_batch_size for part in parts] == [local] * count
  if stream == "steps":
    rows = local * count
    for p, part in enumerate(parts):  # the plan rows: process p's block of the step's rows
      epochs, plan_rows = part.plan_rows(4)
      assert (epochs == 0).all()
      assert plan_rows.tolist() == [4 * rows + p * local + j for j in range(local)]


def expected_state(stream, docs, steps):
  """The position after `steps` global steps, from the plan's row count or the step count of
  unpacked sampling."""
  if stream == "rows":
    lengths = np.array([len(d) for d in docs])
    per_epoch = packing.plan(lengths, SEQ_LEN, strategy="ffd", extra_tokens=2).num_rows
    consumed = steps * BATCH
  else:
    per_epoch, consumed = math.ceil(len(docs) / EXAMPLES), steps
  return {"version": 1, "unit": stream, "epoch": consumed // per_epoch,
          "index": consumed % per_epoch, "epoch_length": per_epoch}


def steps_into_epoch_1(stream, docs):
  """Global steps from the start to a step inside epoch 1 (not at its start)."""
  per_epoch = expected_state(stream, docs, 0)["epoch_length"]
  return per_epoch // BATCH + 1 if stream == "rows" else per_epoch + 1


@pytest.mark.parametrize("stream", ["rows", "steps"])
def test_the_iterator_state_is_one_format_for_both_streams(stream):
  docs = make_docs()
  iterators = [build(stream, docs, process_index=p, process_count=2).iterator()
               for p in range(2)]
  done = 0
  for steps in (0, 1, steps_into_epoch_1(stream, docs)):
    for _ in range(steps - done):
      for it in iterators:
        next(it)
    done = steps
    assert iterators[0].position() == expected_position(stream, docs, steps)
    states = [it.get_state() for it in iterators]
    assert tuple(states[0]) == STATE_KEYS and states[0] == states[1]
    assert states[0] == expected_state(stream, docs, steps)
  assert states[0]["epoch"] == 1 and states[0]["index"] > 0


def expected_position(stream, docs, steps):
  state = expected_state(stream, docs, steps)
  return segpack.StreamPosition(epoch=state["epoch"], index=state["index"])


@pytest.mark.parametrize("stream,before,after", [
    ("rows", 2, 2), ("rows", 4, 1), ("rows", 1, 4), ("rows", 2, 4),
    ("steps", 2, 2), ("steps", 4, 1), ("steps", 1, 4), ("steps", 2, 3),
])
def test_a_resumed_iterator_continues_with_the_uninterrupted_rows(stream, before, after):
  """Saved after `m` steps on `before` processes, restored (through JSON, as the checkpoint
  keeps it) on `after`: the next steps are the uninterrupted run's, in order, across the end of
  epoch 0; over both runs every (epoch, plan row) of the row stream comes once."""
  docs = make_docs()
  n = 3  # the switch is in epoch 0, the end in epoch 1
  m = steps_into_epoch_1(stream, docs) - 2
  uninterrupted = build(stream, docs, process_index=0, process_count=1).iterator()
  want = [next(uninterrupted) for _ in range(m + n)]
  first = [build(stream, docs, process_index=p, process_count=before).iterator()
           for p in range(before)]
  got, seen = [], collections.Counter()

  def step(iterators):
    got.append(joined([next(it) for it in iterators]))
    for it in iterators:
      seen.update(zip(*(a.tolist() for a in it.last_plan_rows)))

  for _ in range(m):
    step(first)
  states = [it.get_state() for it in first]
  assert all(s == states[0] for s in states)
  assert states[0] == expected_state(stream, docs, m)
  state = json.loads(json.dumps(states[0]))
  second = [build(stream, docs, process_index=p, process_count=after).iterator()
            for p in range(after)]
  for it in second:
    it.set_state(state)
  for _ in range(n):
    step(second)
  assert second[0].get_state() == uninterrupted.get_state()
  assert second[0].get_state()["epoch"] == 1
  for k, (g, w) in enumerate(zip(got, want)):
    assert_batch(g, w, label=f"step {k}")
  if stream == "rows":  # no row dropped or repeated
    rows = expected_state("rows", docs, 0)["epoch_length"]
    assert set(seen.values()) == {1} and sum(seen.values()) == (m + n) * BATCH
    assert {r for e, r in seen if e == 0} == set(range(rows))


def _other(stream):
  return "steps" if stream == "rows" else "rows"


@pytest.mark.parametrize("stream", ["rows", "steps"])
@pytest.mark.parametrize("state, match", [
    ({"epoch": 0, "index": 8, "rows_per_epoch": 40}, "has no 'version': it is of an older format"),
    ({"next_index": 3}, r"\{'next_index': 3\} has no 'version'"),
    ({"version": 2}, "version=2; this version reads version 1 only"),
    ({"version": 1, "epoch": 0, "index": 0}, "exactly the keys version, unit, epoch, index, "
                                              "epoch_length, got epoch, index, version"),
    ("other", "unit='OTHER', but this iterator counts 'SELF': it is a state of the other stream"),
    ("index=-1", "index must be an int >= 0, got index=-1"),
    ("length", "epoch_length=999, but epoch 0 of this data set has"),
    ("past", "needs 0 <= index < "),
    ("bool", "epoch must be an int >= 0, got epoch=True"),
])
def test_a_state_of_another_format_is_refused_in_one_line(stream, state, match):
  docs = make_docs()
  it = build(stream, docs, process_index=0, process_count=1).iterator()
  good = it.get_state()
  edits = {"other": {"unit": _other(stream)}, "index=-1": {"index": -1},
           "length": {"epoch_length": 999}, "past": {"index": good["epoch_length"]},
           "bool": {"epoch": True}}
  if isinstance(state, str):
    state = {**good, **edits[state]}
  match = match.replace("OTHER", _other(stream)).replace("SELF", stream)
  with pytest.raises(StreamStateError, match=match) as caught:
    it.set_state(state)
  assert "\n" not in str(caught.value)
  assert it.get_state() == good  # a refused state leaves the iterator where it was


def test_the_checkpoint_data_item_is_checked_one_way():
  good = {"version": 1, "unit": "steps", "epoch": 2, "index": 5, "epoch_length": 15}
  ckpt_compat.check_data_item({"format": 3, "iterator": good, "process_count": 2}, where="D")
  cases = [
      ({"format": 2, "iterator": {"epoch": 0, "index": 8, "rows_per_epoch": 40},
        "process_count": 2}, "^D: its data item has format 2, this version reads format 3 only"),
      ({"format": 3, "iterator": {"next_index": 4}, "process_count": 2},
       "^D: iterator state .* has no 'version'.*; start a new --workdir$"),
      ({"format": 3, "iterator": good, "process_count": 0}, "process_count=0"),
  ]
  for item, match in cases:
    with pytest.raises(ckpt_compat.DataStateError, match=match) as caught:
      ckpt_compat.check_data_item(item, where="D")
    assert "\n" not in str(caught.value)


def _spec(mode):
  return data_configs.data_config(source="synthetic", size="small", cache_dir=None, seq_len=128,
                           strategy="ffd", long_docs="split", max_segments_per_row=None,
                           add_bos=True, add_eos=True, seed=0, synthetic_docs=60,
                           synthetic_mean_len=10, synthetic_vocab=97, mode=mode,
                           examples_per_batch=4 if mode == "minibatch" else None)


@pytest.mark.parametrize("mode", ["global", "minibatch"])
def test_trainer_batches_split_and_resume_one_way_in_both_packing_modes(mode):
  """`make_data` on 1, 2 and 4 processes: the parts are the one-process batch in order, the
  iterator states have one form, and a state saved on 2 processes resumes on 4."""
  def data(p, q):
    return data_lib.make_data(_spec(mode), batch_size=8, process_index=p, process_count=q)

  one = data(0, 1)
  for q in (2, 4):
    parts = [data(p, q) for p in range(q)]
    for k in (0, 20):
      assert_batch(joined([d.train[k] for d in parts]), one.train[k], label=f"{mode} {q} {k}")
  whole = one.train_iterator(read_options=None)
  assert isinstance(whole, StreamIterator)  # both modes' iterator
  want = [next(whole) for _ in range(20)]
  two = [data(p, 2).train_iterator(read_options=None) for p in range(2)]
  for _ in range(15):
    for it in two:
      next(it)
  state = two[0].get_state()
  assert tuple(state) == STATE_KEYS
  assert state["unit"] == ("rows" if mode == "global" else "steps")
  four = [data(p, 4).train_iterator(read_options=None) for p in range(4)]
  for it in four:
    it.set_state(state)
  for k in range(15, 20):
    assert_batch(joined([next(it) for it in four]), want[k], label=f"{mode} resumed {k}")

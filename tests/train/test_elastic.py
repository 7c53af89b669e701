"""Elastic resume: a run saved on P processes resumes on Q with every row consumed exactly once.

Pipeline level (`segpack.data.stream`, processes simulated by index): every consumed row is
counted per (epoch, plan row), and each row's content is checked against an independent oracle:
the plan recomputed with `segpack.packing.plan` (per epoch with `repack="epoch"`) and its rows
assembled by a naive loop from the documents. The plan's row count comes from that oracle too.

Trainer level (slow): real CPU processes through `jax.distributed` (gloo), one workdir trained
on 2, then 1, then 4, then 2 processes (with a batch size change), counting the logged
`[epoch, plan row]` of every row of every step against the plan's row count, with every row's
logged content fingerprint consistent with its plan row.
"""

import collections
import json
import os

import numpy as np
import pytest

import segpack
from segpack import packing
from segpack.data.balance import BalanceOptions
from segpack.data.stream import StreamBatches, StreamPosition, StreamStateError
from configs import packed
from support.train_configs import synthetic_config, train_on_processes
from train import checkpoint_compat as ckpt_compat
from train import config_checks
from train import data_sources as data_sources
from train import data as data_lib
from train import train as train_lib
from support import data_configs  # noqa: E402
from segpack.errors import PipelineConfigError  # noqa: E402

SEQ_LEN, SEED, BOS, EOS = 64, 3, 1, 2


def make_docs(n=160, seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.clip(np.round(rng.lognormal(2.8, 0.9, size=n)), 1, 60).astype(np.int64)
  return [rng.integers(3, 1000, size=int(k), dtype=np.int32) for k in lengths]


def make_stream(docs, *, repack="none"):
  return segpack.pack_dataset(docs, seq_len=SEQ_LEN, seed=SEED, num_epochs=None,
                              repack=repack,
                              special_tokens=segpack.SpecialTokens(bos_id=BOS, eos_id=EOS))


def row_key(input_ids, segment_ids):
  return np.asarray(input_ids, np.int32).tobytes() + np.asarray(segment_ids, np.int32).tobytes()


def oracle_rows(docs, epoch, *, repack):
  """The content key of every plan row of `epoch`: the plan from `packing.plan` (epoch e >= 1 of
  `repack="epoch"` with `tie_seed=(seed, e)`), rows assembled slot by slot."""
  lengths = np.array([len(d) for d in docs])
  tie = (SEED, epoch) if repack == "epoch" and epoch > 0 else None
  plan = packing.plan(lengths, SEQ_LEN, strategy="ffd", extra_tokens=2, tie_seed=tie)
  keys = []
  for r in range(plan.num_rows):
    ids, seg = np.zeros(SEQ_LEN, np.int32), np.zeros(SEQ_LEN, np.int32)
    at = 0
    for n, (doc, start, length) in enumerate(plan.row(r), start=1):
      virtual = [BOS] + docs[doc].tolist() + [EOS]
      for slot in range(length):
        ids[at], seg[at] = virtual[start + slot], n
        at += 1
    keys.append(row_key(ids, seg))
  return keys


class Counter:
  """Counts consumed (epoch, plan row) and checks every row's content against the oracle."""

  def __init__(self, docs, *, repack):
    self.docs, self.repack = docs, repack
    self.counts = collections.Counter()
    self._oracle = {}

  def rows_in_epoch(self, epoch):
    return len(self.oracle(epoch))

  def oracle(self, epoch):
    if epoch not in self._oracle:
      self._oracle[epoch] = oracle_rows(self.docs, epoch, repack=self.repack)
    return self._oracle[epoch]

  def add(self, batch, plan_rows):
    epochs, rows = plan_rows
    for n, (e, r) in enumerate(zip(epochs.tolist(), rows.tolist())):
      assert row_key(batch["input_ids"][n], batch["segment_ids"][n]) == self.oracle(e)[r], (e, r)
      self.counts[e, r] += 1

  def check_epochs(self, num_epochs):
    """Epochs < num_epochs: every plan row exactly once; later epochs: at most once."""
    rows = self.rows_in_epoch(0)
    for e in range(num_epochs):
      got = {r: self.counts[e, r] for r in range(rows)}
      assert set(got.values()) == {1}, (e, {r: c for r, c in got.items() if c != 1})
    assert all(c == 1 for c in self.counts.values())
    assert all(0 <= r < rows for _, r in self.counts)


def run_processes(stream, counter, *, count, batch, steps, ranks=None, state=None):
  """`count` simulated processes take `steps` global batches from `state`; returns the state."""
  balance = None if ranks is None else BalanceOptions(num_ranks=ranks)
  parts = [StreamBatches(stream, global_batch_size=batch, process_index=p, process_count=count,
                         balance=balance) for p in range(count)]
  iterators = [b.iterator() for b in parts]
  if state is not None:
    for it in iterators:
      it.set_state(state)
  for _ in range(steps):
    for it in iterators:
      local = next(it)
      assert len(local["input_ids"]) == batch // count
      counter.add(local, it.last_plan_rows)
  states = [it.get_state() for it in iterators]
  assert all(s == states[0] for s in states)  # one position, whatever the process
  return states[0]


def _ranks(count, batch):
  """Two devices per process where the batch splits over them, else one."""
  return 2 * count if batch % (2 * count) == 0 else count


@pytest.mark.parametrize("before,after,balance,repack", [
    ((2, 8), (1, 8), False, "none"),  # 2 -> 1
    ((1, 8), (4, 8), True, "none"),  # 1 -> 4, balanced over 4 / 8 ranks
    ((4, 8), (2, 8), True, "epoch"),  # 4 -> 2, with a fresh plan every epoch
    ((2, 8), (1, 6), False, "epoch"),  # 2 -> 1 and the global batch size 8 -> 6
    ((1, 6), (4, 12), True, "none"),  # 1 -> 4 and 6 -> 12, balanced
])
def test_resume_on_another_process_count_consumes_every_row_once(before, after, balance, repack):
  docs = make_docs()
  counter = Counter(docs, repack=repack)
  stream = make_stream(docs, repack=repack)
  rows = counter.rows_in_epoch(0)
  assert stream.rows_in_epoch(0) == rows  # the stream has no padding rows
  (p, b1), (q, b2) = before, after
  steps1 = rows // b1 + 2  # into epoch 1, mid-epoch
  state = run_processes(stream, counter, count=p, batch=b1, steps=steps1,
                        ranks=_ranks(p, b1) if balance else None)
  assert state == {"version": 1, "unit": "rows", "epoch": 1, "index": steps1 * b1 - rows,
                   "epoch_length": rows}
  assert 0 < state["index"]  # the switch is inside epoch 1
  fresh = make_stream(docs, repack=repack)  # a new run: nothing carried over but the state
  steps2 = -(-(3 * rows - steps1 * b1) // b2)  # through epoch 2
  end = run_processes(fresh, counter, count=q, batch=b2, steps=steps2,
                      ranks=_ranks(q, b2) if balance else None, state=state)
  assert end["epoch"] * rows + end["index"] == steps1 * b1 + steps2 * b2 >= 3 * rows
  counter.check_epochs(3)
  assert sum(counter.counts.values()) == steps1 * b1 + steps2 * b2


def test_stream_batches_are_contiguous_blocks_of_the_stream():
  """Without balance, process p of Q reads stream rows [k*B + p*B/Q, k*B + (p+1)*B/Q)."""
  docs = make_docs(100, seed=1)
  stream = make_stream(docs)
  whole = [stream[t] for t in range(40)]
  for q in (1, 2, 4):
    for p in range(q):
      part = StreamBatches(stream, global_batch_size=8, process_index=p, process_count=q,
                           start=StreamPosition(epoch=0, index=4))
      for k in range(4):
        got = part[k]["input_ids"]
        want = [whole[4 + k * 8 + p * (8 // q) + n]["input_ids"] for n in range(8 // q)]
        np.testing.assert_array_equal(got, np.stack(want))


def test_bad_arguments_and_states_are_refused_by_name():
  docs = make_docs(60, seed=2)
  stream = make_stream(docs)
  with pytest.raises(PipelineConfigError, match="global_batch_size=6 is not divisible"):
    StreamBatches(stream, global_batch_size=6, process_index=0, process_count=4)
  with pytest.raises(PipelineConfigError, match="num_ranks=3"):
    StreamBatches(stream, global_batch_size=8, process_index=0, process_count=2,
                  balance=BalanceOptions(num_ranks=3))
  it = StreamBatches(stream, global_batch_size=4, process_index=0, process_count=1).iterator()
  rows = stream.rows_in_epoch(0)
  state = dict(version=1, unit="rows", epoch=0, index=0)
  with pytest.raises(StreamStateError, match=f"epoch_length={rows + 1}, but epoch 0 .* {rows}"):
    it.set_state({**state, "epoch_length": rows + 1})
  with pytest.raises(StreamStateError, match=f"index={rows}"):
    it.set_state({**state, "epoch": 1, "index": rows, "epoch_length": rows})
  with pytest.raises(StreamStateError, match="next_index.*has no 'version'"):
    it.set_state({"next_index": 3})


def test_trainer_data_stream_and_checkpoint_format(tmp_path):
  """`make_data` gives a stream whose global batches, read by 1 or 2 processes, hold the same
  rows; the checkpoint refuses a batch size change unless allowed, and names the flag."""
  spec = data_configs.data_config(source="synthetic", size="small", cache_dir=None, seq_len=64,
                           strategy="ffd", long_docs="split", max_segments_per_row=None,
                           add_bos=True, add_eos=True, seed=0, synthetic_docs=120,
                           synthetic_mean_len=25, synthetic_vocab=97, repack="epoch")
  one = data_lib.make_data(spec, batch_size=8, process_index=0, process_count=1)
  two = [data_lib.make_data(spec, batch_size=8, process_index=p, process_count=2)
         for p in range(2)]
  for k in (0, 5, 11):
    joined = np.concatenate([d.train[k]["input_ids"] for d in two])
    np.testing.assert_array_equal(joined, one.train[k]["input_ids"])
  with pytest.raises(PipelineConfigError, match="repack must be one of"):  # the library's check
    data_lib.make_data(data_configs.data_config(spec, **{ "repack": "always"}),
                       batch_size=8, process_index=0, process_count=1)
  config = packed.get_config()
  assert config.packing.repack == "none"
  config.packing.repack = "epoch"
  assert config.packing.repack == "epoch"
  with pytest.raises(config_checks.ConfigError, match="packing.repack='epoch' is for"):
    config_checks.check_config(data_configs.data_config(spec, **{ "mode": "minibatch",
                                                                    "examples_per_batch": 4}))
  saved = {"train": {"batch_size": 8}, "packing": {"repack": "epoch"}}
  current = {"train": {"batch_size": 4}, "packing": {"repack": "epoch"}}
  assert ckpt_compat.config_differences(saved, current) == [
      "train.batch_size: checkpoint has 8, config has 4"]
  assert ckpt_compat.config_differences(saved, current,
                                     also_resumable=frozenset({"train.batch_size"})) == []


def test_minibatch_steps_resume_on_another_process_count():
  """Minibatch packing: step k is the same global minibatch on any process count, so the
  position in steps saved on 2 processes resumes on 4 with the same rows per step, in order."""
  docs = make_docs(80, seed=5)

  def steps(index, count):
    return segpack.pack_minibatches(
        docs, seq_len=SEQ_LEN, examples_per_batch=6, rows_per_batch=8, seed=SEED,
        special_tokens=segpack.SpecialTokens(bos_id=BOS, eos_id=EOS), process_index=index,
        process_count=count)

  whole = steps(0, 1)
  two = [steps(p, 2).iterator() for p in range(2)]
  for _ in range(3):
    for it in two:
      next(it)
  states = [it.get_state() for it in two]
  assert states[0] == states[1] == {"version": 1, "unit": "steps", "epoch": 0, "index": 3,
                                    "epoch_length": 14}
  four = [steps(p, 4).iterator() for p in range(4)]
  for it in four:
    it.set_state(states[0])
  for k in range(3, 20):  # into the second epoch
    got = np.concatenate([next(it)["input_ids"] for it in four])
    np.testing.assert_array_equal(got, whole[k]["input_ids"], err_msg=str(k))


def test_trainer_refuses_a_batch_size_change_unless_allowed(tmp_path):
  """Resuming with another `train.batch_size` names the flag that allows it (the allowed
  change is trained in `test_trainer_resumes_2_to_1_to_2_processes_on_another_batch`)."""
  base = {"train.eval_every": 0, "attention.self_check": False}
  train_lib.train_and_evaluate(synthetic_config(**base, **{"train.num_steps": 1}), str(tmp_path))
  bigger = {**base, "train.num_steps": 2, "train.batch_size": 16}
  with pytest.raises(ckpt_compat.IncompatibleCheckpointError,
                     match=r"batch_size: checkpoint has 8, config has 16(.|\n)*"
                           r"allow_batch_size_change=True"):
    train_lib.train_and_evaluate(synthetic_config(**bigger), str(tmp_path))
  data_item = json.loads((tmp_path / "checkpoints" / "1" / "data" / "metadata").read_text())
  assert data_item["format"] == 3 and data_item["process_count"] == 1
  assert data_item["iterator"] == {"version": 1, "unit": "rows", "epoch": 0, "index": 8,
                                   "epoch_length": data_item["iterator"]["epoch_length"]}


def _phase(workdir, *, count, steps, batch):
  """Trains `workdir` up to `steps` on `count` local CPU processes (4 devices in all)."""
  overrides = {"train.num_steps": steps, "train.batch_size": batch,
               "train.allow_batch_size_change": True, "train.eval_every": 0,
               "train.checkpoint_every": 0, "train.log_every": 1, "data.synthetic_docs": 50,
               "packing.balance": "attention", "model.num_layers": 1,
               "attention.self_check": False}
  out = train_on_processes(workdir, f"synthetic_config(**{overrides!r})", count=count, devices=4)
  return json.loads(out.strip().splitlines()[-1]), out


def _logged(workdir):
  records = []
  for name in sorted(os.listdir(workdir)):
    if name.startswith("batches") and name.endswith(".jsonl"):
      with open(os.path.join(workdir, name)) as f:
        records += [json.loads(line) for line in f]
  return records


@pytest.mark.slow
def test_trainer_resumes_2_to_1_to_2_processes_on_another_batch(tmp_path):
  """One run over 2, 1 and 2 processes (batch 8, 8, 12): every plan row once per epoch. (The
  stream itself resumes 1 -> 4 and back, balanced, in the tests above.)"""
  work = tmp_path / "run"
  phases = [(2, 3, 8), (1, 7, 8), (2, 13, 12)]  # (processes, last step, batch)
  resumed, logs = [], []
  for count, steps, batch in phases:
    summary, log = _phase(work, count=count, steps=steps, batch=batch)
    resumed.append(summary["resumed_from"])
    logs.append(log)
  assert resumed == [0, 3, 7]
  assert "changes: processes: 2 -> 1\n" in logs[1]
  assert "changes: processes: 1 -> 2; train.batch_size: 8 -> 12" in logs[2]
  records = _logged(work)
  # Oracle: the plan's rows from the documents' lengths, outside the trainer.
  docs = data_sources.synthetic_documents(num_docs=50, mean_len=30, vocab=97, seed=0)
  rows = packing.plan(np.array([len(d) for d in docs]), SEQ_LEN, extra_tokens=2).num_rows
  consumed = sum(b * (s - prev) for (_, s, b), prev in zip(phases, [0, 3, 7]))
  assert consumed >= 3 * rows  # three whole epochs at least
  counts = collections.Counter()
  content = {}
  for rec in records:
    for (epoch, row), fingerprint in zip(rec["plan_rows"], rec["rows"]):
      counts[epoch, row] += 1
      assert content.setdefault(row, fingerprint) == fingerprint  # a plan row: one content
  assert sum(counts.values()) == consumed
  assert len(set(content.values())) == len(content) == rows  # distinct rows, all of them
  last = max(e for e, _ in counts)
  for epoch in range(last):
    assert [counts[epoch, r] for r in range(rows)] == [1] * rows, epoch
  assert all(c == 1 for c in counts.values())
  steps = sorted({rec["step"] for rec in records})
  assert steps == list(range(1, 14))
  with open(work / "metrics.jsonl") as f:
    losses = [json.loads(line)["loss"] for line in f if '"train"' in line]
  assert len(losses) == 13 and all(np.isfinite(losses))
  assert all(0.5 * np.log(97) < x < 1.2 * np.log(97) for x in losses), losses

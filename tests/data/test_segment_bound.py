"""The static bound on segments per row, from the data to the cuDNN backend.

`PackedDataset.segment_bound` against a naive count over the rows the dataset yields; the
trainer's `Data.segment_bound` (global and minibatch packing); and `train.setup` handing
that bound, rounded up by `round_segment_bound`, to the model (its `cudnn_segment_bound`).
"""

import numpy as np
import pytest

from configs import packed
from segpack.attention import cudnn
from segpack.data.options import SpecialTokens
from segpack.data.packed import PlanOptions, pack_dataset
from train import data as data_lib
from train.model import decoder as model_lib
from support import data_configs  # noqa: E402

IDS = SpecialTokens(bos_id=1, eos_id=2)


def _docs(n, *, seed, max_len):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 500, size=int(rng.integers(1, max_len + 1))).astype(np.int32)
          for _ in range(n)]


def _runs(row):
  """Non-zero runs of a row of segment ids, by a plain walk."""
  runs, prev = 0, 0
  for sid in row.tolist():
    runs += sid != 0 and sid != prev
    prev = sid
  return runs


def _naive_max(datasets):
  return max(_runs(ds[i]["segment_ids"]) for ds in datasets for i in range(len(ds)))


@pytest.mark.parametrize("cap", [None, 3, 5])
def test_segment_bound_is_the_most_any_yielded_row_holds(cap):
  docs = _docs(300, seed=0, max_len=12)  # short documents: many per row
  rows = pack_dataset(docs, plan=PlanOptions(seq_len=48, max_segments_per_row=cap),
                      num_epochs=1, special_tokens=IDS)
  want = _naive_max([rows])  # over every row of the epoch
  assert rows.segment_bound == want
  if cap is None:
    assert want > 5  # the caps below bind
  else:
    assert want == cap
  assert isinstance(rows.segment_bound, int)


def test_segment_bound_of_one_document_per_row():
  ds = pack_dataset(_docs(20, seed=1, max_len=30), seq_len=64, num_epochs=1, strategy="pad",
                    special_tokens=IDS)
  assert ds.segment_bound == _naive_max([ds]) == 1


def _spec(**overrides):
  kw = dict(source="synthetic", size="small", cache_dir=None, seq_len=64, strategy="ffd",
            long_docs="split", max_segments_per_row=None, add_bos=True, add_eos=True, seed=0,
            synthetic_docs=300, synthetic_mean_len=10, synthetic_vocab=97)
  kw.update(overrides)
  return data_configs.data_config(**kw)


def test_trainer_data_bound_global_mode():
  data = data_lib.make_data(_spec(), batch_size=4, process_index=0, process_count=1)
  train_rows = data.train_rows_in_epoch0
  batches = [data.train[i] for i in range(-(-train_rows // 4))]
  evals = [data.eval[i] for i in range(len(data.eval))]
  want = max(_runs(r) for b in batches + evals for r in b["segment_ids"])
  assert data.segment_bound == want > 1
  capped = data_lib.make_data(_spec(max_segments_per_row=3), batch_size=4, process_index=0,
                              process_count=1)
  assert capped.segment_bound == 3


def test_trainer_data_bound_minibatch_mode():
  # seq_len 256 holds every synthetic document (at most 20 x the mean + BOS/EOS) whole.
  data = data_lib.make_data(_spec(mode="minibatch", examples_per_batch=6, seq_len=256),
                            batch_size=8, process_index=0, process_count=1)
  seen = max(_runs(r) for i in range(30) for r in data.train[i]["segment_ids"])
  assert 6 >= seen > 1  # a training row holds pieces of distinct examples of its minibatch
  evals = max(_runs(r) for i in range(len(data.eval)) for r in data.eval[i]["segment_ids"])
  assert data.segment_bound == max(6, evals)  # eval rows are packed globally
  budget = data_lib.make_data(_spec(mode="minibatch", tokens_per_batch=8 * 256, seq_len=256),
                              batch_size=8, process_index=0, process_count=1)
  assert budget.segment_bound is None


def test_trainer_hands_the_data_bound_to_the_model(tmp_path, monkeypatch):
  """`train.setup` builds the model with the data's bound (not `packing.max_segments_per_row`),
  which `build` rounds up to the cuDNN N."""
  from train import setup as setup_lib  # pylint: disable=g-import-not-at-top
  c = packed.get_config("smoke")
  with c.unlocked():
    c.data.source = "synthetic"
    c.data.synthetic_docs, c.data.synthetic_mean_len, c.data.synthetic_vocab = 300, 10, 97
    c.packing.seq_len = 64
    c.packing.max_segments_per_row = 7
    c.attention.implementation = "cudnn"
    c.attention.self_check = False  # the startup self-check would run cuDNN, absent on a CPU
  seen = []
  real_build = model_lib.build

  def build(*args, **kwargs):
    model = real_build(*args, **kwargs)
    seen.append((kwargs.get("segment_bound"), model.cfg.attention_cudnn_segment_bound))
    return model

  monkeypatch.setattr(model_lib, "build", build)
  run = setup_lib.setup(c, str(tmp_path))
  assert seen and all(got == (run.data.segment_bound, 8) for got in seen)
  assert run.data.segment_bound == 7  # the cap binds on these short documents
  assert cudnn.round_segment_bound(7) == 8

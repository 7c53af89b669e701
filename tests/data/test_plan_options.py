"""One `PlanOptions` for `pack_dataset`, `pack_minibatches` and `pack_pairs`: given the same
options, each plans exactly the rows of its keyword spelling (`seq_len=`, `strategy=`,
`long_docs=`); the two spellings together, a `plan` that is not a `PlanOptions`, and a field an
entry point does not apply are refused by name and value."""

import numpy as np
import pytest

import segpack
from segpack.data import pairs as pairs_lib
from support.masked_source import MaskedDocs

BOS, EOS = 1, 2
IDS = segpack.SpecialTokens(bos_id=BOS, eos_id=EOS)
ONE_PROCESS = dict(process_index=0, process_count=1)


def _docs(n=60, seed=0, max_len=70):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 900, int(rng.integers(1, max_len))).astype(np.int32) for _ in range(n)]


def _pairs(n=30, seed=1):
  rng = np.random.default_rng(seed)
  docs, masks = [], []
  for _ in range(n):
    prompt = rng.integers(3, 90, int(rng.integers(1, 10)))
    for _ in range(2):
      answer = rng.integers(3, 90, int(rng.integers(1, 20)))
      docs.append(np.concatenate([prompt, answer]).astype(np.int32))
      masks.append(np.concatenate([np.zeros(prompt.size), np.ones(answer.size)]).astype(np.uint8))
  return MaskedDocs(docs, masks)


def _elements(ds, n=None):
  return [ds[i] for i in range(len(ds) if n is None else n)]


def _same(a, b):
  return len(a) == len(b) and all(
      x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


SETTINGS = [
    dict(seq_len=32),
    dict(seq_len=24, strategy="bfd", long_docs=segpack.LongDocs(overlap=4, min_len=3)),
    dict(seq_len=40, strategy="sorted_pad", long_docs=segpack.LongDocs(mode="truncate")),
    dict(seq_len=16, strategy="greedy"),
    dict(seq_len=32, strategy="pad"),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.get('strategy', 'ffd')}")
def test_pack_dataset_plans_the_rows_of_its_keywords(settings, tmp_path):
  docs = _docs()
  common = dict(seed=3, num_epochs=2, special_tokens=IDS)
  keywords = segpack.pack_dataset(docs, plan_cache_dir=tmp_path / "a", **settings, **common)
  options = segpack.pack_dataset(docs, plan=segpack.PlanOptions(**settings),
                                 plan_cache_dir=tmp_path / "b", **common)
  assert _same(_elements(keywords), _elements(options))
  assert keywords.segment_bound == options.segment_bound
  assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(
      p.name for p in (tmp_path / "b").iterdir())  # one cache key for both spellings


def test_pack_dataset_repacks_the_same_epochs():
  docs = _docs(200, max_len=30)
  common = dict(seed=5, num_epochs=3, special_tokens=IDS, repack="epoch")
  keywords = segpack.pack_dataset(docs, seq_len=48, strategy="bfd", **common)
  options = segpack.pack_dataset(docs, plan=segpack.PlanOptions(seq_len=48, strategy="bfd"),
                                 **common)
  assert _same(_elements(keywords), _elements(options))


@pytest.mark.parametrize("settings", SETTINGS[:3], ids=lambda s: f"{s.get('strategy', 'ffd')}")
def test_pack_minibatches_plans_the_steps_of_its_keywords(settings):
  docs = _docs()
  common = dict(seed=2, num_epochs=2, special_tokens=IDS, examples_per_batch=5, **ONE_PROCESS)
  keywords = segpack.pack_minibatches(docs, **settings, **common)
  options = segpack.pack_minibatches(docs, plan=segpack.PlanOptions(**settings), **common)
  assert keywords.rows_per_batch == options.rows_per_batch
  assert _same(_elements(keywords), _elements(options))


@pytest.mark.parametrize("strategy", ["ffd", "greedy"])
def test_pack_pairs_plans_the_rows_of_its_keywords(strategy):
  src = _pairs()
  common = dict(seed=4, num_epochs=2, special_tokens=IDS, shared_prefix=True)
  keywords = pairs_lib.pack_pairs(src, seq_len=96, strategy=strategy, **common)
  options = pairs_lib.pack_pairs(src, plan=segpack.PlanOptions(seq_len=96, strategy=strategy),
                                 **common)
  every = np.arange(len(keywords))  # pair rows are built in batches (`get_batch`)
  assert len(keywords) == len(options)
  assert _same([keywords.get_batch(every)], [options.get_batch(every)])


def test_one_options_object_serves_all_three():
  plan = segpack.PlanOptions(seq_len=96, strategy="bfd")
  docs = _pairs()
  rows = segpack.pack_dataset(docs, plan=plan, num_epochs=1, special_tokens=IDS)
  steps = segpack.pack_minibatches(docs, plan=plan, num_epochs=1, special_tokens=IDS,
                                   examples_per_batch=4, **ONE_PROCESS)
  pairs = pairs_lib.pack_pairs(docs, plan=plan, num_epochs=1, special_tokens=IDS)
  assert rows.seq_len == steps.seq_len == pairs.seq_len == 96


def test_the_segment_cap_is_a_field_of_the_plan():
  docs = _docs(300, max_len=10)
  capped = segpack.pack_dataset(docs, plan=segpack.PlanOptions(seq_len=64, max_segments_per_row=3),
                                num_epochs=1, special_tokens=IDS)
  assert max(int(r["segment_ids"].max()) for r in capped) <= 3 == capped.segment_bound
  with pytest.raises(TypeError, match="max_segments_per_row"):  # no keyword of its own
    segpack.pack_dataset(docs, seq_len=64, max_segments_per_row=3)


@pytest.mark.parametrize("fn", ["pack_dataset", "pack_minibatches", "pack_pairs"])
def test_both_spellings_neither_or_a_wrong_plan_are_refused(fn):
  call = {"pack_dataset": segpack.pack_dataset,
          "pack_pairs": pairs_lib.pack_pairs,
          "pack_minibatches": lambda src, **kw: segpack.pack_minibatches(
              src, examples_per_batch=2, **ONE_PROCESS, **kw)}[fn]
  src, plan = _pairs(4), segpack.PlanOptions(seq_len=64)
  with pytest.raises(segpack.PipelineConfigError,
                     match=rf"^{fn}: pass the packing settings once, .* and seq_len=64$"):
    call(src, plan=plan, seq_len=64, special_tokens=IDS)
  with pytest.raises(segpack.PipelineConfigError, match=f"^{fn}: needs seq_len="):
    call(src, special_tokens=IDS)
  with pytest.raises(segpack.PipelineConfigError,
                     match=f"^{fn}: plan must be a segpack.PlanOptions, got plan={{'seq_len'"):
    call(src, plan={"seq_len": 64}, special_tokens=IDS)
  with pytest.raises(segpack.PipelineConfigError, match=f"^{fn}: seq_len must be an int >= 1"):
    call(src, seq_len="64", special_tokens=IDS)  # the keyword spelling names its entry point


@pytest.mark.parametrize("fn, fields", [
    ("pack_minibatches", dict(max_segments_per_row=2)),
    ("pack_minibatches", dict(batch_size=4)),
    ("pack_pairs", dict(long_docs=segpack.LongDocs(min_len=3))),
    ("pack_pairs", dict(max_segments_per_row=2)),
    ("pack_pairs", dict(pad_multiple=64)),
])
def test_a_field_the_entry_point_does_not_apply_is_refused(fn, fields):
  name, value = next(iter(fields.items()))
  plan = segpack.PlanOptions(seq_len=64, **fields)
  with pytest.raises(segpack.PipelineConfigError,
                     match=rf"^{fn}: plan.{name}={value!r} does not apply".replace("(", r"\(")
                     .replace(")", r"\)")):
    if fn == "pack_pairs":
      pairs_lib.pack_pairs(_pairs(4), plan=plan, special_tokens=IDS)
    else:
      segpack.pack_minibatches(_docs(8), plan=plan, examples_per_batch=2, special_tokens=IDS,
                               **ONE_PROCESS)

"""The option groups of `pack_dataset` / `pack_minibatches`, and the deprecated flat keywords.

Every deprecated keyword must warn, name its replacement, and give exactly the rows of the new
spelling; each case also checks that the option changed the rows (so a keyword that is silently
dropped on both paths fails), with the expected effect read off the rows directly.
"""

import types
import warnings

import grain
import numpy as np
import pytest

import segpack
from segpack.data import sources
from train import data as data_lib

FEATURES = ("input_ids", "labels", "segment_ids", "segment_positions")
BOS, EOS = 1, 2


class Docs(list):
  """Documents that carry their tokenizer's BOS/EOS ids, as a shard source does."""

  bos_id = BOS
  eos_id = EOS


def make_docs(n=30, seed=0, max_len=40):
  rng = np.random.default_rng(seed)
  return Docs(rng.integers(10, 1000, size=int(rng.integers(1, max_len + 1))).astype(np.int32)
              for _ in range(n))


def one_shard():
  return grain.sharding.ShardOptions(shard_index=0, shard_count=1)


def all_elements(ds):
  return [ds[i] for i in range(len(ds))]


def same(a, b):
  return len(a) == len(b) and all(
      np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in FEATURES)


def real_slots(docs, *, extra=2, seq_len=16, overlap=0, mode="split", min_len=0):
  """Non-padding slots the contract gives: every kept document's chunks, counted naively."""
  total = 0
  for doc in docs:
    if len(doc) < min_len:
      continue
    n, start = len(doc) + extra, 0
    while True:
      total += min(seq_len, n - start)
      if start + seq_len >= n or mode == "truncate":
        break
      start += seq_len - overlap
  return total


def slots(els):
  return sum(int((e["segment_ids"] > 0).sum()) for e in els)


def holds(els, token):
  return any((e["input_ids"] == token).any() for e in els)


DOCS = make_docs()

# (deprecated keywords, the same in the new spelling, a check of the effect on the rows)
CASES = {
    "add_bos": (dict(add_bos=False), dict(special_tokens=segpack.SpecialTokens(add_bos=False)),
                lambda els: not holds(els, BOS) and slots(els) == real_slots(DOCS, extra=1)),
    "add_eos": (dict(add_eos=False), dict(special_tokens=segpack.SpecialTokens(add_eos=False)),
                lambda els: not holds(els, EOS) and slots(els) == real_slots(DOCS, extra=1)),
    "bos_id": (dict(bos_id=7), dict(special_tokens=segpack.SpecialTokens(bos_id=7)),
               lambda els: holds(els, 7) and not holds(els, BOS)),
    "eos_id": (dict(eos_id=8), dict(special_tokens=segpack.SpecialTokens(eos_id=8)),
               lambda els: holds(els, 8) and not holds(els, EOS)),
    "pad_id": (dict(pad_id=9), dict(special_tokens=segpack.SpecialTokens(pad_id=9)),
               lambda els: all((e["input_ids"][e["segment_ids"] == 0] == 9).all() for e in els)
               and holds(els, 9)),
    "long_docs": (dict(long_docs="truncate"), dict(long_docs=segpack.LongDocs(mode="truncate")),
                  lambda els: slots(els) == real_slots(DOCS, mode="truncate")),
    "min_len": (dict(min_len=20), dict(long_docs=segpack.LongDocs(min_len=20)),
                lambda els: slots(els) == real_slots(DOCS, min_len=20)),
    "overlap": (dict(overlap=4), dict(long_docs=segpack.LongDocs(overlap=4)),
                lambda els: slots(els) == real_slots(DOCS, overlap=4)),
    "long_docs+min_len+overlap": (
        dict(long_docs="truncate", min_len=3, overlap=2),
        dict(long_docs=segpack.LongDocs(mode="truncate", min_len=3, overlap=2)),
        lambda els: slots(els) == real_slots(DOCS, mode="truncate", min_len=3)),
    "shard_index+shard_count": (
        dict(shard_index=1, shard_count=2),
        dict(shard_options=grain.sharding.ShardOptions(shard_index=1, shard_count=2)),
        lambda els: 0 < slots(els) < real_slots(DOCS)),
    "bos_id+eos_id+pad_id": (
        dict(bos_id=7, eos_id=8, pad_id=9),
        dict(special_tokens=segpack.SpecialTokens(bos_id=7, eos_id=8, pad_id=9)),
        lambda els: holds(els, 7) and holds(els, 8) and holds(els, 9) and not holds(els, 0)),
}


def _pack(fn, docs, **kw):
  base = dict(seq_len=16, num_epochs=1, seed=3)
  if "shard_index" not in kw and "shard_options" not in kw:
    base["shard_options"] = one_shard()
  if fn == "pack_minibatches":
    return segpack.pack_minibatches(docs, examples_per_batch=4, **base, **kw)
  return segpack.pack_dataset(docs, **base, **kw)


def _rows(fn, ds):
  els = all_elements(ds)
  if fn == "pack_dataset":
    return els
  return [{k: v[r] for k, v in b.items()} for b in els for r in range(len(b["input_ids"]))]


@pytest.mark.parametrize("fn", ["pack_dataset", "pack_minibatches"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_deprecated_keyword_warns_and_equals_the_new_spelling(fn, case):
  old, new, effect = CASES[case]
  with pytest.warns(DeprecationWarning) as record:
    got = _pack(fn, DOCS, **old)
  ours = [w for w in record if str(w.message).startswith(f"{fn}: ")]
  replacement = next(iter(new))  # special_tokens, long_docs or shard_options
  for name in old:
    assert any(name in str(w.message) and replacement in str(w.message) for w in ours), ours
  assert all(w.filename == __file__ for w in ours)  # the warning points at the caller
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    want = _pack(fn, DOCS, **new)
    default = _pack(fn, DOCS)
  assert same(all_elements(got), all_elements(want))
  assert not same(all_elements(want), all_elements(default))  # the option did something
  assert slots(_rows(fn, default)) == real_slots(DOCS)
  assert effect(_rows(fn, want)), case


def test_overlap_repeats_slots_of_the_previous_chunk():
  docs = Docs([np.arange(10, 50, dtype=np.int32)])  # 42 virtual slots, chunks of 16, stride 12
  with pytest.warns(DeprecationWarning, match="overlap"):
    old = segpack.pack_dataset(docs, seq_len=16, num_epochs=1, shuffle=False, overlap=4,
                               shard_options=one_shard())
  new = segpack.pack_dataset(docs, seq_len=16, num_epochs=1, shuffle=False,
                             long_docs=segpack.LongDocs(overlap=4), shard_options=one_shard())
  assert same(all_elements(old), all_elements(new))
  virtual = [BOS] + list(range(10, 50)) + [EOS]
  chunks = sorted(tuple(r["input_ids"][r["segment_ids"] > 0].tolist()) for r in new)
  assert chunks == sorted(tuple(virtual[c:c + 16]) for c in (0, 12, 24, 36))


@pytest.mark.parametrize("old, new", [
    (dict(mode="minibatch", examples_per_batch=3), dict(examples_per_batch=3)),
    (dict(mode="minibatch", tokens_per_batch=48), dict(tokens_per_batch=48)),
    (dict(mode="minibatch", examples_per_batch=3, rows_per_batch=9),
     dict(examples_per_batch=3, rows_per_batch=9)),
    (dict(mode="minibatch", examples_per_batch=7, drop_remainder=True),
     dict(examples_per_batch=7, drop_remainder=True)),
])
def test_minibatch_mode_of_pack_dataset_warns_and_equals_pack_minibatches(old, new):
  docs = make_docs()
  common = dict(seq_len=16, num_epochs=2, seed=5, shard_options=one_shard())
  with pytest.warns(DeprecationWarning, match="pack_minibatches") as record:
    got = segpack.pack_dataset(docs, **common, **old)
  assert all(w.filename == __file__ for w in record if "pack_dataset" in str(w.message))
  want = segpack.pack_minibatches(docs, **common, **new)
  assert isinstance(got, segpack.MinibatchPackedDataset)
  assert same(all_elements(got), all_elements(want))
  if "rows_per_batch" in new:
    assert want.rows_per_batch == 9 and want[0]["input_ids"].shape == (9, 16)
  if "drop_remainder" in new:
    assert len(want) == 2 * (len(docs) // 7)  # 30 examples: 4 full batches per epoch


def test_mode_global_warns_and_changes_nothing():
  docs = make_docs()
  with pytest.warns(DeprecationWarning, match="mode"):
    got = segpack.pack_dataset(docs, seq_len=16, num_epochs=1, shard_options=one_shard(),
                               mode="global", drop_remainder=False)
  want = segpack.pack_dataset(docs, seq_len=16, num_epochs=1, shard_options=one_shard())
  assert isinstance(got, segpack.PackedDataset) and same(all_elements(got), all_elements(want))


def test_deprecated_mode_errors():
  docs = make_docs(5)
  kw = dict(seq_len=16, shard_options=one_shard())
  with pytest.raises(segpack.PipelineConfigError, match="mode must be 'global' or 'minibatch', "
                     "got 'mini'"):
    segpack.pack_dataset(docs, mode="mini", **kw)
  with pytest.raises(segpack.PipelineConfigError,
                     match="examples_per_batch=4 is only for minibatch packing"):
    segpack.pack_dataset(docs, examples_per_batch=4, **kw)
  with pytest.warns(DeprecationWarning), pytest.raises(
      segpack.PipelineConfigError, match="max_segments_per_row=2 is not supported"):
    segpack.pack_dataset(docs, mode="minibatch", examples_per_batch=2, max_segments_per_row=2,
                         **kw)


@pytest.mark.parametrize("fn", [segpack.pack_dataset, segpack.pack_minibatches])
@pytest.mark.parametrize("kw, names", [
    (dict(bos_id=1, special_tokens=segpack.SpecialTokens(add_eos=False)),
     ["bos_id=1", "special_tokens=SpecialTokens("]),
    (dict(pad_id=0, add_bos=True, special_tokens=segpack.SpecialTokens()),
     ["add_bos=True", "pad_id=0", "special_tokens="]),
    (dict(min_len=3, long_docs=segpack.LongDocs(overlap=1)), ["min_len=3", "long_docs=LongDocs("]),
    (dict(overlap=2, long_docs=segpack.LongDocs()), ["overlap=2", "long_docs="]),
    (dict(shard_index=0, shard_count=1, shard_options=grain.sharding.ShardOptions(0, 1)),
     ["shard_index=0", "shard_count=1", "shard_options=ShardOptions("]),
])
def test_old_keyword_with_its_group_is_an_error_naming_both(fn, kw, names):
  extra = dict(examples_per_batch=2) if fn is segpack.pack_minibatches else {}
  with pytest.raises(segpack.PipelineConfigError) as e:
    fn(make_docs(5), seq_len=16, **extra, **kw)
  for name in names:
    assert name in str(e.value), (name, str(e.value))


def test_unknown_keywords_raise_type_error_naming_them():
  with pytest.raises(TypeError, match="sq_len, strat"):
    segpack.pack_dataset(make_docs(5), seq_len=16, strat="ffd", sq_len=3)
  with pytest.raises(TypeError, match="max_segments_per_row"):
    segpack.pack_minibatches(make_docs(5), seq_len=16, examples_per_batch=2,
                             max_segments_per_row=2)
  with pytest.raises(TypeError, match="mode"):
    segpack.pack_minibatches(make_docs(5), seq_len=16, examples_per_batch=2, mode="minibatch")
  with pytest.raises(TypeError, match="positional"):
    segpack.pack_dataset(make_docs(5), 16)  # keyword-only


@pytest.mark.parametrize("kw, match", [
    (dict(special_tokens=segpack.SpecialTokens(add_bos="yes")),
     "special_tokens.add_bos must be a bool, got 'yes'"),
    (dict(special_tokens=segpack.SpecialTokens(pad_id=-1)),
     "special_tokens.pad_id must be an int >= 0, got -1"),
    (dict(special_tokens=segpack.SpecialTokens(bos_id=True)),
     "special_tokens.bos_id must be None or an int >= 0, got True"),
    (dict(special_tokens={"bos_id": 1}), "special_tokens must be a segpack.SpecialTokens"),
    (dict(long_docs=segpack.LongDocs(mode="drop")),
     "long_docs.mode must be one of split, truncate, got 'drop'"),
    (dict(long_docs=segpack.LongDocs(overlap=16)), r"long_docs.overlap .*\[0, 16\), got 16"),
    (dict(long_docs=segpack.LongDocs(min_len=-1)), "long_docs.min_len must .*got -1"),
    (dict(shard_options=object()), "shard_options must be a grain.sharding.ShardOptions"),
    (dict(shard_options=types.SimpleNamespace(shard_index=2, shard_count=2,
                                              drop_remainder=False)),
     r"shard_options.shard_index must be an int in \[0, 2\), got 2"),
    (dict(shard_options=types.SimpleNamespace(shard_index=0, shard_count=0,
                                              drop_remainder=False)),
     "shard_options.shard_count must be an int >= 1, got 0"),
    (dict(shard_options=types.SimpleNamespace(shard_index=0, shard_count=1,
                                              drop_remainder=None)),
     "shard_options.drop_remainder must be a bool, got None"),
])
@pytest.mark.parametrize("fn", ["pack_dataset", "pack_minibatches"])
def test_group_errors_name_the_field_and_echo_the_value(fn, kw, match):
  kw = {"shard_options": one_shard(), **kw}
  extra = dict(examples_per_batch=2) if fn == "pack_minibatches" else {}
  with pytest.raises(segpack.PipelineConfigError, match=f"^{fn}: {match}"):
    getattr(segpack, fn)(make_docs(5), seq_len=16, **extra, **kw)


def test_special_tokens_resolve_from_the_source_and_unused_ids_are_minus_one():
  docs = make_docs(5)
  got = sources.prepare(docs, fn="f", special_tokens=segpack.SpecialTokens(), loss_mask=None)
  assert got.special == segpack.SpecialTokens(bos_id=BOS, eos_id=EOS)
  got = sources.prepare(docs, fn="f", loss_mask=None,
                        special_tokens=segpack.SpecialTokens(add_bos=False, eos_id=5, pad_id=3))
  assert got.special == segpack.SpecialTokens(add_bos=False, bos_id=-1, eos_id=5, pad_id=3)
  assert got.loss_mask is False and got.lengths.tolist() == [len(d) for d in docs]
  with pytest.raises(segpack.PipelineConfigError,
                     match="f: special_tokens.add_bos=True but special_tokens.bos_id is None"):
    sources.prepare([np.arange(3)], fn="f", special_tokens=segpack.SpecialTokens(),
                    loss_mask=None)


def test_groups_are_frozen_and_exported():
  with pytest.raises(AttributeError):
    segpack.SpecialTokens().bos_id = 3
  with pytest.raises(AttributeError):
    segpack.LongDocs().mode = "truncate"
  assert {"pack_dataset", "pack_minibatches", "SpecialTokens", "LongDocs", "PackedDataset",
          "MinibatchPackedDataset", "PipelineConfigError"} <= set(segpack.__all__)


@pytest.mark.parametrize("mode", ["global", "minibatch"])
def test_trainer_data_path_uses_no_deprecated_keyword(mode):
  spec = data_lib.DataSpec(
      source="synthetic", size="small", cache_dir=None, seq_len=64, strategy="ffd",
      long_docs="split", max_segments_per_row=None, add_bos=True, add_eos=True, seed=0,
      synthetic_docs=40, synthetic_mean_len=8, synthetic_vocab=100, mode=mode,
      examples_per_batch=4 if mode == "minibatch" else None)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    data = data_lib.make_data(spec, batch_size=16, process_index=0, process_count=1)
    first = data.train[0]
  assert not [w for w in record if issubclass(w.category, DeprecationWarning)], [
      str(w.message) for w in record]
  assert first["input_ids"].shape == (16, 64) and (first["segment_ids"] > 0).any()

"""The option groups of `pack_dataset` / `pack_minibatches`.

Every option must change the rows, with the expected effect read off the rows directly (so an
option that is silently dropped fails). A keyword that is not a parameter is a plain TypeError.
"""

import types

import numpy as np
import pytest

import segpack
from segpack.data import sources

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


ONE_PROCESS = dict(process_index=0, process_count=1)


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

# (the option in its group, a check of its effect on the rows)
CASES = {
    "add_bos": (dict(special_tokens=segpack.SpecialTokens(add_bos=False)),
                lambda els: not holds(els, BOS) and slots(els) == real_slots(DOCS, extra=1)),
    "add_eos": (dict(special_tokens=segpack.SpecialTokens(add_eos=False)),
                lambda els: not holds(els, EOS) and slots(els) == real_slots(DOCS, extra=1)),
    "bos_id": (dict(special_tokens=segpack.SpecialTokens(bos_id=7)),
               lambda els: holds(els, 7) and not holds(els, BOS)),
    "eos_id": (dict(special_tokens=segpack.SpecialTokens(eos_id=8)),
               lambda els: holds(els, 8) and not holds(els, EOS)),
    "pad_id": (dict(special_tokens=segpack.SpecialTokens(pad_id=9)),
               lambda els: all((e["input_ids"][e["segment_ids"] == 0] == 9).all() for e in els)
               and holds(els, 9)),
    "long_docs.mode": (dict(long_docs=segpack.LongDocs(mode="truncate")),
                       lambda els: slots(els) == real_slots(DOCS, mode="truncate")),
    "long_docs.min_len": (dict(long_docs=segpack.LongDocs(min_len=20)),
                          lambda els: slots(els) == real_slots(DOCS, min_len=20)),
    "long_docs.overlap": (dict(long_docs=segpack.LongDocs(overlap=4)),
                          lambda els: slots(els) == real_slots(DOCS, overlap=4)),
    "long_docs, all fields": (
        dict(long_docs=segpack.LongDocs(mode="truncate", min_len=3, overlap=2)),
        lambda els: slots(els) == real_slots(DOCS, mode="truncate", min_len=3)),
    "special_tokens, three ids": (
        dict(special_tokens=segpack.SpecialTokens(bos_id=7, eos_id=8, pad_id=9)),
        lambda els: holds(els, 7) and holds(els, 8) and holds(els, 9) and not holds(els, 0)),
}


def _pack(fn, docs, **kw):
  base = dict(seq_len=16, num_epochs=1, seed=3)
  if fn == "pack_minibatches":
    return segpack.pack_minibatches(docs, examples_per_batch=4, **ONE_PROCESS,
                                    **base, **kw)
  return segpack.pack_dataset(docs, **base, **kw)


def _rows(fn, ds):
  els = all_elements(ds)
  if fn == "pack_dataset":
    return els
  return [{k: v[r] for k, v in b.items()} for b in els for r in range(len(b["input_ids"]))]


@pytest.mark.parametrize("fn", ["pack_dataset", "pack_minibatches"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_option_has_its_effect_on_the_rows(fn, case):
  new, effect = CASES[case]
  want = _pack(fn, DOCS, **new)
  default = _pack(fn, DOCS)
  assert not same(all_elements(want), all_elements(default))  # the option did something
  assert slots(_rows(fn, default)) == real_slots(DOCS)
  assert effect(_rows(fn, want)), case


def test_overlap_repeats_slots_of_the_previous_chunk():
  docs = Docs([np.arange(10, 50, dtype=np.int32)])  # 42 virtual slots, chunks of 16, stride 12
  rows = segpack.pack_dataset(docs, seq_len=16, num_epochs=1, shuffle=False,
                              long_docs=segpack.LongDocs(overlap=4))
  virtual = [BOS] + list(range(10, 50)) + [EOS]
  chunks = sorted(tuple(r["input_ids"][r["segment_ids"] > 0].tolist()) for r in rows)
  assert chunks == sorted(tuple(virtual[c:c + 16]) for c in (0, 12, 24, 36))


@pytest.mark.parametrize("fn", ["pack_dataset", "pack_minibatches"])
@pytest.mark.parametrize("old", [
    dict(add_bos=False), dict(bos_id=7), dict(pad_id=9), dict(min_len=3), dict(overlap=2),
    dict(shard_index=0, shard_count=1), dict(mode="minibatch", examples_per_batch=3)])
def test_flat_keywords_are_a_type_error(fn, old):
  """The options live in their groups only (`special_tokens`, `long_docs`; processes:
  `StreamBatches` and `pack_minibatches`, `process_index` / `process_count`); minibatches:
  `pack_minibatches`."""
  if fn == "pack_minibatches":
    old = {k: v for k, v in old.items() if k != "examples_per_batch"}
  with pytest.raises(TypeError, match="unexpected keyword argument '(" + "|".join(old) + ")'"):
    _pack(fn, make_docs(5), **old)


def test_unknown_keywords_raise_type_error_naming_them():
  with pytest.raises(TypeError, match="unexpected keyword argument '(strat|sq_len)'"):
    segpack.pack_dataset(make_docs(5), seq_len=16, strat="ffd", sq_len=3)
  with pytest.raises(TypeError, match="max_segments_per_row"):
    segpack.pack_minibatches(make_docs(5), seq_len=16, examples_per_batch=2,
                             max_segments_per_row=2)
  with pytest.raises(TypeError, match="mode"):
    segpack.pack_minibatches(make_docs(5), seq_len=16, examples_per_batch=2, mode="minibatch")
  with pytest.raises(TypeError, match="positional"):
    segpack.pack_dataset(make_docs(5), 16)  # keyword-only
  with pytest.raises(TypeError, match="balance"):  # balancing is StreamBatches(balance=...)
    segpack.pack_dataset(make_docs(5), seq_len=16, balance=None)


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
])
@pytest.mark.parametrize("fn", ["pack_dataset", "pack_minibatches"])
def test_group_errors_name_the_field_and_echo_the_value(fn, kw, match):
  extra = dict(examples_per_batch=2, **ONE_PROCESS) if fn == "pack_minibatches" else {}
  with pytest.raises(segpack.PipelineConfigError, match=f"^{fn}: {match}"):
    getattr(segpack, fn)(make_docs(5), seq_len=16, **extra, **kw)


@pytest.mark.parametrize("fn", ["StreamBatches", "pack_minibatches"])
@pytest.mark.parametrize("kw, match", [
    (dict(process_index=2, process_count=2), r"process_index must be an int in \[0, 2\), got 2"),
    (dict(process_index=-1, process_count=2), r"process_index must be an int in \[0, 2\), got -1"),
    (dict(process_index=0, process_count=0), "process_count must be an int >= 1, got 0"),
    (dict(process_index=True, process_count=2), r"process_index must .*got True"),
    (dict(process_index=0, process_count=2.0), "process_count must be an int >= 1, got 2.0"),
])
def test_process_errors_name_the_argument_and_echo_the_value(fn, kw, match):
  """Both batch streams say "this process of that many" one way, checked by one function."""
  docs = make_docs(5)
  with pytest.raises(segpack.PipelineConfigError, match=f"^{fn}: {match}"):
    if fn == "StreamBatches":
      segpack.StreamBatches(segpack.pack_dataset(docs, seq_len=16), global_batch_size=4, **kw)
    else:
      segpack.pack_minibatches(docs, seq_len=16, examples_per_batch=2, **kw)


def test_shard_options_is_refused_naming_its_replacement():
  """`pack_minibatches(shard_options=...)` was the second spelling of the process split; it is
  gone (an unexpected keyword)."""
  with pytest.raises(TypeError, match="shard_options"):
    segpack.pack_minibatches(make_docs(5), seq_len=16, examples_per_batch=2, **ONE_PROCESS,
                             shard_options=types.SimpleNamespace(shard_index=0, shard_count=1))
  with pytest.raises(TypeError, match="process_index"):  # no default: the split is explicit
    segpack.pack_minibatches(make_docs(5), seq_len=16, examples_per_batch=2)


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
          "MinibatchPackedDataset", "PipelineConfigError", "StreamBatches",
          "BalanceOptions"} <= set(segpack.__all__)
  with pytest.raises(AttributeError):
    segpack.BalanceOptions(num_ranks=2).num_ranks = 4

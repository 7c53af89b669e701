"""Tests for segpack.data.rows.RowBuilder against a naive per-row oracle: every slot written out
from the virtual sequences ([BOS] + tokens + [EOS]) with plain Python loops."""

import pickle

import numpy as np
import pytest

from support.masked_source import MaskedDocs
from segpack import packing
from segpack.data.options import SpecialTokens
from segpack.data.rows import PADDING_ROW, RowBuilder
from segpack.loss import IGNORE_INDEX

BOS, EOS, PAD = 1, 2, 0


def naive_row(pieces, docs, masks, *, seq_len, overlap, add_bos, add_eos):
  """The four features of one row, slot by slot."""
  ids, labels = [PAD] * seq_len, [IGNORE_INDEX] * seq_len
  seg, pos = [0] * seq_len, [0] * seq_len
  o = 0
  for k, (d, start, n) in enumerate(pieces):
    toks = [int(t) for t in docs[d]]
    virtual = [BOS] * add_bos + toks + [EOS] * add_eos
    last_mask = int(masks[d][-1]) if masks is not None and len(toks) else 0
    vmask = None if masks is None else (
        [0] * add_bos + [int(m) for m in masks[d]] + [last_mask] * add_eos)
    for i in range(n):
      ids[o + i], seg[o + i], pos[o + i] = virtual[start + i], k + 1, i
    for i in range(n - 1):
      repeated = start > 0 and i + 1 < overlap  # target is a repeated overlap slot
      masked = vmask is not None and not vmask[start + i + 1]
      if not repeated and not masked:
        labels[o + i] = virtual[start + i + 1]
    o += n
  return {"input_ids": ids, "labels": labels, "segment_ids": seg, "segment_positions": pos}


def make_case(seed, *, overlap, add_bos, add_eos, masked, mmap_dir=None):
  rng = np.random.default_rng(seed)
  docs = [rng.integers(3, 60000, int(rng.integers(0, 50))).astype(np.int32) for _ in range(40)]
  masks = [(rng.random(len(d)) < 0.6).astype(np.uint8) for d in docs] if masked else None
  lengths = np.array([len(d) for d in docs], np.int64)
  plan = packing.plan(lengths, 24, long_docs=packing.LongDocs(overlap=overlap),
                      extra_tokens=int(add_bos) + int(add_eos))
  if mmap_dir is not None:
    plan.save(mmap_dir)
    plan = packing.Plan.load(mmap_dir, mmap=True)
  source = MaskedDocs(docs, masks) if masked else docs
  special = SpecialTokens(add_bos=add_bos, add_eos=add_eos, bos_id=BOS if add_bos else -1,
                          eos_id=EOS if add_eos else -1, pad_id=PAD)
  builder = RowBuilder(source, plan, special=special, doc_lengths=lengths, loss_mask=masked)
  return builder, plan, docs, masks


@pytest.mark.parametrize("overlap, add_bos, add_eos, masked", [
    (0, True, True, False), (5, True, True, False), (0, False, True, True), (3, True, False, True),
    (0, False, False, False)])
def test_rows_equal_the_naive_oracle(overlap, add_bos, add_eos, masked):
  builder, plan, docs, masks = make_case(overlap, overlap=overlap, add_bos=add_bos,
                                         add_eos=add_eos, masked=masked)
  assert builder.num_rows == plan.num_rows and builder.seq_len == 24
  rows = list(range(plan.num_rows)) + [PADDING_ROW]
  batch = builder.build(rows[::-1])
  for i, r in enumerate(rows[::-1]):
    pieces = [] if r == PADDING_ROW else plan.row(r)
    want = naive_row(pieces, docs, masks, seq_len=24, overlap=overlap, add_bos=add_bos,
                     add_eos=add_eos)
    one = builder.build_row(r)
    for k, v in want.items():
      assert batch[k].dtype == np.int32 and batch[k].shape == (len(rows), 24)
      assert batch[k][i].tolist() == v, (r, k)
      assert one[k].tolist() == v, (r, k)


def test_pickled_builder_over_a_cached_plan_carries_file_references(tmp_path):
  builder, plan, docs, _ = make_case(9, overlap=0, add_bos=True, add_eos=True, masked=False,
                                     mmap_dir=tmp_path / "plan")
  clone = pickle.loads(pickle.dumps(builder))
  assert isinstance(clone._plan.doc, np.memmap)  # an in-memory copy would come back as ndarray
  want = builder.build(np.arange(plan.num_rows))
  got = clone.build(np.arange(plan.num_rows))
  assert all(np.array_equal(got[k], want[k]) for k in want)
  # Another plan over the same source and special tokens.
  other = packing.plan(np.array([len(d) for d in docs]), 24, strategy="pad", extra_tokens=2)
  rows = builder.with_plan(other).build(np.arange(other.num_rows))
  for r in range(other.num_rows):
    want = naive_row(other.row(r), docs, None, seq_len=24, overlap=0, add_bos=True, add_eos=True)
    assert rows["input_ids"][r].tolist() == want["input_ids"]

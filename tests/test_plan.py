"""Tests for segpack.packing.plan: a memory-mapped plan pickles as file references."""

import pickle

import numpy as np

from segpack import packing
from segpack.packing.plan import PlanArrays


def test_memory_mapped_plan_pickles_as_file_references(tmp_path):
  lengths = np.random.default_rng(0).integers(1, 60, 5000)
  packing.plan(lengths, 64, extra_tokens=2).save(tmp_path / "p")
  plan = packing.Plan.load(tmp_path / "p", mmap=True)
  arrays = PlanArrays(seq_len=64, overlap=0, row_splits=plan.row_splits, doc=plan.doc,
                      start=plan.start, length=plan.length)
  blob = pickle.dumps(arrays)
  assert len(blob) < 2_000 < plan.doc.nbytes  # the arrays are not in the pickle
  back = pickle.loads(blob)
  assert isinstance(back.doc, np.memmap) and np.array_equal(back.doc, plan.doc)
  for name in ("row_splits", "start", "length"):
    assert np.array_equal(getattr(back, name), getattr(plan, name)), name

"""The Python blocks of docs/attention.md and docs/packing.md, executed as written with the names
they leave to the reader (q, k, v, segment ids, lengths, datasets under `data/`) and, for the
timing loops, smaller sizes.

Oracles: per-document attention (support/attention_oracle.py); the documents' lengths counted
apart from segpack (every planned token once); the rows' segment rules.
"""

import jax
import numpy as np
import pytest

import segpack
from segpack.bench.packing_sections import write_synthetic_shards
from support import attention_inputs
from support import attention_oracle
from support import doc_blocks

ATTENTION, PACKING = "docs/attention.md", "docs/packing.md"


def _run(doc, heading, namespace, cwd, subs=None):
  text = doc_blocks.block(doc, heading).text
  for a, b in (subs or {}).items():
    assert a in text, a
    text = text.replace(a, b)
  return doc_blocks.python_block(text, namespace, cwd)


@pytest.fixture(scope="module")
def qkv():
  q, k, v, _ = attention_inputs.random_inputs(0, 4, 128, 4, 2, 32)
  seg = attention_inputs.layouts(128)
  want, _ = attention_oracle.reference(q, k, v, seg, causal=True)
  return q, k, v, seg, want


def _page_imports():
  """What the page's first block imports, which its later blocks use."""
  from segpack.attention import PallasOptions, segment_attention
  return {"PallasOptions": PallasOptions, "segment_attention": segment_attention}


def test_the_call_with_every_argument(qkv, tmp_path):
  q, k, v, seg, want = qkv
  ns = _run(ATTENTION, "# Segment attention", {"q_BxSxHxD": q, "k_BxSxKxD": k, "v_BxSxKxD": v,
                                               "segment_ids_BxS": seg}, tmp_path)
  np.testing.assert_allclose(np.asarray(ns["out_BxSxHxD"]), want, atol=2e-5)


def test_the_backend_settings_block_in_interpret_mode(qkv, tmp_path):
  """The `PallasOptions` defaults and the Pallas call in interpret mode; the block's last value
  is compared by running its call again, kept."""
  q, k, v, seg, want = qkv
  heading = "## Per-backend settings, and the rules about backends"
  text = doc_blocks.block(ATTENTION, heading).text
  last = text.strip().splitlines()[-1]
  assert last.startswith("segment_attention(q, k, v, seg, implementation=\"pallas\"")
  ns = {"q": q, "k": k, "v": v, "seg": seg, **_page_imports()}
  ns = doc_blocks.python_block(text.replace(last, "out = " + last), ns, tmp_path)
  np.testing.assert_allclose(np.asarray(ns["out"]), want, atol=2e-5)


def test_balance_then_context_parallelism_on_a_mesh(qkv, tmp_path):
  """docs/attention.md's "Balance" block reorders a batch for 2 context devices, then the
  "Context parallelism" block attends over a data x fsdp x context x tensor mesh: back in the
  natural order, per-document attention."""
  q, k, v, seg, want = qkv
  batch = {"segment_ids": seg, "q": np.asarray(q), "k": np.asarray(k), "v": np.asarray(v)}
  ns = _run(ATTENTION, "### Balance", {"seg": seg, "cp": 2, "batch": batch}, tmp_path)
  slot = ns["slot_index"]
  assert sorted(ns["batch"]) == ["k", "q", "segment_ids", "slot_index", "v"]
  mesh = jax.make_mesh((2, 1, 2, 2), segpack.mesh.MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Explicit,) * 4)
  b = ns["batch"]
  ns = _run(ATTENTION, "## Context parallelism", {
      "q": b["q"], "k": b["k"], "v": b["v"], "segment_ids": b["segment_ids"], "slot_index": slot,
      "mesh": mesh, "segpack": segpack, **_page_imports()}, tmp_path)
  natural = np.take_along_axis(np.asarray(ns["out"]), np.argsort(slot, axis=1)[..., None, None],
                               axis=1)
  np.testing.assert_allclose(natural, want, atol=2e-5)


def _dataset(path, lengths, vocab=1000):
  write_synthetic_shards(str(path), np.asarray(lengths, np.int64), vocab_size=vocab)


def test_the_packing_blocks(tmp_path):
  rng = np.random.default_rng(1)
  lengths = rng.integers(1, 5000, 300)
  ns = _run(PACKING, "## Packers and plans (`segpack.packing`)", {"lengths": lengths}, tmp_path)
  p = ns["p"]
  planned = sorted((d, s, n) for r in range(p.num_rows) for d, s, n in p.row(r))
  per_doc = {}
  for d, _, n in planned:
    per_doc[d] = per_doc.get(d, 0) + n
  assert per_doc == {d: int(n) + 2 for d, n in enumerate(lengths)}  # + BOS and EOS, split rows
  _dataset(tmp_path / "data" / "train", rng.integers(1, 900, 1200))  # 64 rows and more
  ns = _run(PACKING, "## Pipeline (`segpack.pack_dataset`)", {}, tmp_path)
  assert {k: v.shape for k, v in ns["batch"].items()} == {
      k: (8, 4096) for k in ("input_ids", "labels", "segment_ids", "segment_positions")}
  assert ns["batch"]["segment_ids"][:, 0].tolist() == [1] * 8
  ns = _run(PACKING, "### Processes and elastic resume (`segpack.StreamBatches`)", {}, tmp_path)
  assert ns["local"]["input_ids"].shape == (64, 4096)
  assert ns["state"]["epoch"] == 0 and ns["state"]["index"] == 64
  _dataset(tmp_path / "data" / "web", rng.integers(1, 900, 200))
  _dataset(tmp_path / "data" / "code", rng.integers(1, 900, 200))
  ns = _run(PACKING, "### Mixtures (`segpack.Mixture`)", {}, tmp_path)
  assert [s.name for s in ns["mix"].sources] == ["web", "code"]
  assert ns["rows"][0]["input_ids"].shape == (4096,)


def test_the_timing_blocks_at_a_smaller_size(tmp_path, capsys):
  _run(PACKING, "### Rows", {}, tmp_path, subs={"1_000_000": "20_000"})
  _run(PACKING, "### Speed", {}, tmp_path, subs={
      "tempfile.mkdtemp()": repr(str(tmp_path / "speed")),  # the test's directory, removed
      "60_000": "3_000", "b[next(ix)], 400,": "b[next(ix)], 4,", "next(it1), 400,": "next(it1), 4,",
      "g[next(ix)], 200,": "g[next(ix)], 2,", "next(it2), 200,": "next(it2), 2,",
      "ds[next(ix)], 1600,": "ds[next(ix)], 8,"})
  out = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in out[:4]] == ["8", "16", "32", "64"]
  assert len(out) == 9 and all(line.endswith("M tokens/s") for line in out[4:])

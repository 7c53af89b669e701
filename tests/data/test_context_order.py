"""segpack.data.context_order and its benchmark against naive references and brute force."""

import json
import time

import numpy as np
import pytest

from segpack.attention.context_parallel import context_comm_bytes
from segpack.bench import attention as bench_attention
from segpack.bench import attention_context as bench
from segpack.cli import main as cli
from segpack.data import attention_cost
from segpack.data import context_order as order_lib


def _naive_query_costs(seg_BxS):
  """Per slot, the keys k <= j of the same (non-zero) id, by a loop."""
  out = np.zeros(seg_BxS.shape, np.int64)
  for b, row in enumerate(seg_BxS):
    for j, sid in enumerate(row):
      if sid:
        out[b, j] = sum(1 for k in range(j + 1) if row[k] == sid)
  return out


def random_rows(rng, b, s, *, max_len=None):
  """Contiguous packed rows: ids 1..k with random lengths, then a random padding tail."""
  seg = np.zeros((b, s), np.int32)
  for r in range(b):
    used, sid = int(rng.integers(0, s // 4 + 1)), 1
    pos = 0
    while pos < s - used:
      n = int(rng.integers(1, (max_len or s) + 1))
      n = min(n, s - used - pos)
      seg[r, pos:pos + n] = sid
      pos, sid = pos + n, sid + 1
  return seg


def _matchings(items):
  """Every way to split `items` into unordered pairs."""
  if not items:
    yield []
    return
  first, rest = items[0], items[1:]
  for i, partner in enumerate(rest):
    for m in _matchings(rest[:i] + rest[i + 1:]):
      yield [(first, partner)] + m


def _chunks_of_devices(slot_index_S, cp):
  """Per device, the sorted chunk numbers its positions hold (checking they are whole chunks)."""
  s = len(slot_index_S)
  c = s // (2 * cp)
  out = []
  for d in range(cp):
    part = slot_index_S[d * s // cp:(d + 1) * s // cp]
    chunks = part.reshape(2, c)
    assert np.array_equal(chunks - chunks[:, :1], np.broadcast_to(np.arange(c), (2, c)))
    assert chunks[0, 0] % c == 0 and chunks[1, 0] % c == 0
    out.append(tuple(sorted(int(x) // c for x in chunks[:, 0])))
  return out


def test_worked_example_of_the_docstring():
  seg = np.array([[1, 1, 1, 1, 1, 2, 2, 0]])
  assert attention_cost.query_costs(seg).tolist() == [[1, 2, 3, 4, 5, 1, 2, 0]]
  expect = {"none": ([0, 1, 2, 3, 4, 5, 6, 7], [10, 8]),
            "zigzag": ([0, 1, 6, 7, 2, 3, 4, 5], [5, 13]),
            "documents": ([2, 3, 6, 7, 0, 1, 4, 5], [9, 9])}
  for balance, (index, costs) in expect.items():
    got = order_lib.context_order(segment_ids_BxS=seg, context_size=2, balance=balance)
    assert got.dtype == np.int32 and got.tolist() == [index], balance
    assert order_lib.device_costs(segment_ids_BxS=seg, slot_index_BxS=got,
                                  context_size=2).tolist() == [costs]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_orders_are_permutations_ascending_per_device(cp):
  rng = np.random.default_rng(cp)
  s = 2 * cp * 6
  seg = random_rows(rng, 5, s, max_len=3 * s // 4)
  for balance in order_lib.CONTEXT_BALANCES:
    index = order_lib.context_order(segment_ids_BxS=seg, context_size=cp, balance=balance)
    assert index.shape == seg.shape and index.dtype == np.int32
    for row in index:
      assert sorted(row.tolist()) == list(range(s))
      for part in row.reshape(cp, s // cp):
        assert np.all(np.diff(part) > 0)


def test_none_is_the_identity_and_zigzag_the_textbook_layout():
  seg = random_rows(np.random.default_rng(1), 3, 48)
  assert np.array_equal(order_lib.context_order(segment_ids_BxS=seg, context_size=3,
                                                balance="none"),
                        np.tile(np.arange(48), (3, 1)))
  for cp in (1, 2, 3, 4):
    s, c = 2 * cp * 3, 3
    zz = order_lib.context_order(segment_ids_BxS=seg[:, :s], context_size=cp, balance="zigzag")
    textbook = []
    for i in range(cp):  # device i: chunk i, then chunk 2cp-1-i
      textbook += list(range(i * c, (i + 1) * c)) + list(range((2 * cp - 1 - i) * c,
                                                                (2 * cp - i) * c))
    assert zz.tolist() == [textbook] * 3


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_documents_reaches_the_brute_force_optimum(cp):
  rng = np.random.default_rng(10 + cp)
  s = 2 * cp * 8
  seg = np.concatenate([random_rows(rng, 12, s, max_len=n) for n in (4, s // 3, s)])
  for row in seg:
    costs = _naive_query_costs(row[None])[0]
    chunk_cost = costs.reshape(2 * cp, -1).sum(axis=1)
    best = min(max(chunk_cost[a] + chunk_cost[b] for a, b in m)
               for m in _matchings(list(range(2 * cp))))
    index = order_lib.context_order(segment_ids_BxS=row[None], context_size=cp,
                                    balance="documents")[0]
    pairs = _chunks_of_devices(index, cp)
    assert max(chunk_cost[a] + chunk_cost[b] for a, b in pairs) == best
    got = order_lib.device_costs(segment_ids_BxS=row[None], slot_index_BxS=index[None],
                                 context_size=cp)[0]
    assert got.max() == best and got.sum() == costs.sum()
    for other in ("none", "zigzag"):
      other_index = order_lib.context_order(segment_ids_BxS=row[None], context_size=cp,
                                            balance=other)
      assert best <= order_lib.device_costs(segment_ids_BxS=row[None],
                                            slot_index_BxS=other_index, context_size=cp).max()


def test_documents_is_zigzag_for_one_document_and_for_padding():
  full = np.ones((1, 64), np.int32)
  empty = np.zeros((1, 64), np.int32)
  for seg in (full, empty):
    for cp in (2, 4, 8):
      assert np.array_equal(
          order_lib.context_order(segment_ids_BxS=seg, context_size=cp, balance="documents"),
          order_lib.context_order(segment_ids_BxS=seg, context_size=cp, balance="zigzag"))


def test_reorder_then_inverse_gives_back_the_batch():
  rng = np.random.default_rng(2)
  b, s = 3, 32
  seg = random_rows(rng, b, s, max_len=12)
  batch = {"segment_ids": seg, "ids": rng.integers(0, 100, (b, s)),
           "positions": rng.integers(0, 9, (b, s)), "loss_weights": rng.random((b, s)),
           "embeddings": rng.random((b, s, 5)), "row_id": np.arange(b), "note": "x"}
  index = order_lib.context_order(segment_ids_BxS=seg, context_size=4, balance="documents")
  out = order_lib.reorder(batch, slot_index_BxS=index)
  assert np.array_equal(out["slot_index"], index) and out["slot_index"].dtype == np.int32
  assert out["row_id"] is batch["row_id"] and out["note"] == "x"
  inverse = np.argsort(index, axis=1)
  for name in ("segment_ids", "ids", "positions", "loss_weights", "embeddings"):
    for r in range(b):
      assert np.array_equal(out[name][r][inverse[r]], batch[name][r]), name
      assert np.array_equal(out[name][r], batch[name][r][index[r]]), name
  with pytest.raises(order_lib.ContextOrderError, match="slot_index"):
    order_lib.reorder(out, slot_index_BxS=index)


def test_reordered_mask_is_the_original_mask_and_costs_follow():
  rng = np.random.default_rng(3)
  cp, s = 4, 40
  seg = random_rows(rng, 3, s, max_len=15)
  for balance in order_lib.CONTEXT_BALANCES:
    index = order_lib.context_order(segment_ids_BxS=seg, context_size=cp, balance=balance)
    out = order_lib.reorder({"segment_ids": seg}, slot_index_BxS=index)
    for r in range(3):
      sr, slot = out["segment_ids"][r], out["slot_index"][r]
      # The attention's mask in the new layout: same non-zero id and slot[k] <= slot[q].
      mask = (sr[:, None] == sr[None, :]) & (sr[:, None] != 0) & (slot[None, :] <= slot[:, None])
      orig = (seg[r][:, None] == seg[r][None, :]) & (seg[r][:, None] != 0) & np.tri(s, dtype=bool)
      assert np.array_equal(mask, orig[np.ix_(slot, slot)])
      naive = mask.sum(axis=1).reshape(cp, -1).sum(axis=1)
      assert np.array_equal(order_lib.device_costs(segment_ids_BxS=seg[r:r + 1],
                                                   slot_index_BxS=index[r:r + 1],
                                                   context_size=cp)[0], naive)


def test_errors_name_the_argument_and_value():
  seg = np.ones((1, 12), np.int32)
  cases = [
      (dict(balance="striped", context_size=2), "balance.*'striped'"),
      (dict(balance="zigzag", context_size=4), "S=12.*2 \\* context_size = 8"),
      (dict(balance="none", context_size=5), "S=12.*context_size = 5"),
      (dict(balance="documents", context_size=0), "context_size.*0"),
  ]
  for kwargs, pattern in cases:
    with pytest.raises(order_lib.ContextOrderError, match=pattern):
      order_lib.context_order(segment_ids_BxS=seg, **kwargs)
  with pytest.raises(order_lib.ContextOrderError, match="segment_ids_BxS.*float"):
    order_lib.context_order(segment_ids_BxS=seg.astype(float), context_size=2, balance="none")
  with pytest.raises(order_lib.ContextOrderError, match="negative id -1"):
    order_lib.context_order(segment_ids_BxS=-seg, context_size=2, balance="documents")
  with pytest.raises(order_lib.ContextOrderError, match="not a permutation"):
    order_lib.device_costs(segment_ids_BxS=seg, slot_index_BxS=np.zeros((1, 12), np.int32),
                           context_size=2)
  with pytest.raises(order_lib.ContextOrderError, match=r"shape \(1, 6\)"):
    order_lib.device_costs(segment_ids_BxS=seg, slot_index_BxS=np.zeros((1, 6), np.int32),
                           context_size=2)


def test_a_million_slots_in_well_under_a_second_or_two():
  seg = bench.packed_rows(2**20, num_rows=1, mean=8000, sigma=1.0, seed=0)
  order_lib.context_order(segment_ids_BxS=seg, context_size=8, balance="documents")  # warm up
  t0 = time.perf_counter()
  index = order_lib.context_order(segment_ids_BxS=seg, context_size=8, balance="documents")
  assert time.perf_counter() - t0 < 2.0  # about 0.05 s on the 2-core development machine
  costs = order_lib.device_costs(segment_ids_BxS=seg, slot_index_BxS=index, context_size=8)
  assert costs.sum() == sum(n * (n + 1) // 2 for n in np.bincount(seg[0])[1:])


def test_packed_rows_come_from_the_plan():
  seg = bench.packed_rows(4096, num_rows=5, mean=800, sigma=1.0, seed=4)
  assert seg.shape == (5, 4096)
  for row in seg:
    ids = row[row != 0]
    assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(np.unique(ids)) == 1)
    assert np.all(row[len(ids):] == 0)


def test_comm_bytes_by_hand():
  # S = 8, cp = 2: 4 remote slots; k and v 4 x 1 x 1 x 2 bytes each, twice (forward all-gather,
  # backward reduce-scatter): 32 bytes; int32 segment ids and slot indices: 2 x 4 x 4 = 32.
  assert context_comm_bytes(seq_len=8, kv_heads=1, head_dim=1, dtype_bytes=2,
                            context_size=2)["total"] == 64
  assert context_comm_bytes(seq_len=8, kv_heads=1, head_dim=1, dtype_bytes=2, context_size=2,
                            batch=3)["total"] == 192
  assert context_comm_bytes(seq_len=8, kv_heads=8, head_dim=128, dtype_bytes=2,
                            context_size=1)["total"] == 0


def test_benchmark_at_a_tiny_size(capsys):
  argv = ["--context", "--seq-lens", "1024", "2048", "--context-sizes", "2", "4",
          "--means", "100", "600", "--rows", "6", "--min-rows", "6", "--repeats", "1"]
  assert bench_attention.main(argv + ["--json"]) == 0
  records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert len(records) == 8
  for r in records:
    s, cp = r["seq_len"], r["context_size"]
    assert r["comm_bytes_per_layer"] == (2 * 2 * 8 * 128 * 2 + 2 * 4) * s * (cp - 1) // cp
    assert r["rows"] == 6 and r["step_ms"] == "not yet measured"
    for balance in order_lib.CONTEXT_BALANCES:
      assert r[f"max_over_mean_{balance}"] >= 1.0
    # Per row, "documents" is optimal among two-chunk assignments, which "none" and "zigzag"
    # are too; so its average ratio is at most theirs.
    assert r["max_over_mean_documents"] <= r["max_over_mean_zigzag"] + 1e-12
    assert r["max_over_mean_documents"] <= r["max_over_mean_none"] + 1e-12
    assert r["worst_documents"] >= r["max_over_mean_documents"]
  assert cli.main(["bench", "attention"] + argv[:7] + ["--means", "600", "--rows", "2"]) == 0
  table = capsys.readouterr().out
  assert "contiguous" in table and "zigzag" in table and "not yet measured" in table
  with pytest.raises(SystemExit) as exit_info:
    bench.main(["--seq-lens", "1000", "--context-sizes", "8"])
  assert exit_info.value.code == 2
  assert "--seq-lens 1000" in capsys.readouterr().err.splitlines()[-1]

"""`pack_pairs` rows against a naive oracle that rebuilds every pair from its source documents
with plain loops, and the epoch property: over random length distributions, every pair is in
exactly one row of every epoch, and over the processes of `StreamBatches` in exactly one step
and one process."""

import numpy as np
import pytest

from segpack import shards
from segpack.data import pairs as pairs_lib
from segpack.data.options import SpecialTokens
from segpack.data.stream import StreamBatches
from segpack.text import chat
from segpack.text.chat import files as chat_files
from segpack.text.tokenizers import spm
from support.masked_source import MaskedDocs

BOS, EOS = 1, 2


def _source(rng, n, *, long_prompts=False):
  docs, masks = [], []
  for _ in range(n):
    p = int(rng.integers(8, 40) if long_prompts else rng.integers(1, 12))
    prompt = rng.integers(3, 90, p)
    for _ in range(2):
      answer = rng.integers(3, 90, int(rng.integers(1, 30)))
      docs.append(np.concatenate([prompt, answer]).astype(np.int32))
      masks.append(np.concatenate([np.zeros(p), np.ones(answer.size)]).astype(np.uint8))
  return MaskedDocs(docs, masks)


def _oracle_sequence(src, d):
  """Virtual sequence of document d and its trained targets (the EOS takes the last mask)."""
  ids = [BOS] + list(src[d]) + [EOS]
  trained = [0] + list(src.loss_mask(d)) + [int(src.loss_mask(d)[-1])]
  return ids, trained


@pytest.mark.parametrize("shared", [False, True])
def test_rows_rebuild_every_pair_as_the_naive_oracle_writes_it(shared):
  rng = np.random.default_rng(0)
  src = _source(rng, 40, long_prompts=shared)
  rows = pairs_lib.pack_pairs(src, seq_len=160, shuffle=False, num_epochs=1,
                              special_tokens=SpecialTokens(bos_id=BOS, eos_id=EOS),
                              shared_prefix=shared)
  batch = rows._builder.build(np.arange(rows.rows_in_epoch(0)))  # pylint: disable=protected-access
  found = set()
  for b in range(batch["input_ids"].shape[0]):
    seg, pos = batch["segment_ids"][b], batch["segment_positions"][b]
    for j in np.flatnonzero(batch["pair_index"][b] >= 0):
      k = int(batch["pair_index"][b, j])
      found.add(k)
      for which, d in (("chosen", 2 * k), ("rejected", 2 * k + 1)):
        s = batch[f"pair_{which}_segment"][b, j]
        mine = seg == s
        ids, trained = _oracle_sequence(src, d)
        start = int(pos[mine][0])
        if shared:  # the branch continues its prompt segment, which it sees
          prefix = batch["prefix_segment_ids"][b][mine]
          assert (prefix == prefix[0]).all() and prefix[0] > 0
          before = seg == prefix[0]
          np.testing.assert_array_equal(batch["input_ids"][b][before], ids[:start])
          np.testing.assert_array_equal(pos[before], np.arange(start))
          assert (batch["labels"][b][before] == -100).all()
        else:
          assert start == 0
        np.testing.assert_array_equal(batch["input_ids"][b][mine], ids[start:])
        np.testing.assert_array_equal(pos[mine], np.arange(start, len(ids)))
        want = [ids[t + 1] if trained[t + 1] else -100 for t in range(start, len(ids) - 1)]
        np.testing.assert_array_equal(batch["labels"][b][mine], want + [-100])
  assert found == set(range(40))
  if shared:
    assert rows.pairs.stats["slots_saved"] > 0
  else:
    assert "prefix_segment_ids" not in batch


@pytest.mark.parametrize("seed", range(4))
def test_every_pair_is_trained_once_per_epoch_in_one_step_and_one_process(seed):
  rng = np.random.default_rng(seed)
  src = _source(rng, int(rng.integers(20, 120)), long_prompts=bool(seed % 2))
  seq_len, batch_size = int(rng.choice([96, 160, 320])), 4
  special = SpecialTokens(bos_id=BOS, eos_id=EOS)
  rows = pairs_lib.pack_pairs(src, seq_len=seq_len, seed=seed, special_tokens=special,
                              shared_prefix=bool(seed % 2))
  epoch_rows = rows.rows_in_epoch(0)
  steps = 2 * epoch_rows // batch_size  # two epochs
  seen = {}  # pair -> [(step, process)] in the first epoch's rows
  for process in range(2):
    stream = StreamBatches(rows, global_batch_size=batch_size, process_index=process,
                           process_count=2)
    for step in range(steps):
      batch = stream[step]
      for b in range(batch["pair_index"].shape[0]):
        offset = step * batch_size + process * (batch_size // 2) + b
        for k in batch["pair_index"][b][batch["pair_index"][b] >= 0]:
          seen.setdefault((offset // epoch_rows, int(k)), []).append((step, process))
  for epoch in (0, 1):
    if (epoch + 1) * epoch_rows > steps * batch_size:
      break
    for k in range(len(src) // 2):
      assert len(seen[(epoch, k)]) == 1, (epoch, k, seen.get((epoch, k)))


def test_held_out_pairs_keep_pairs_whole():
  src = _source(np.random.default_rng(3), 50)
  train, held = pairs_lib.held_out_pairs(src, share=0.2)
  assert len(train) + len(held) == 100 and len(held) % 2 == 0
  for part in (train, held):
    ids = np.asarray(part.parent_ids)
    assert (ids[0::2] % 2 == 0).all() and (ids[1::2] == ids[0::2] + 1).all()
  assert not set(train.parent_ids.tolist()) & set(held.parent_ids.tolist())


def test_a_source_that_is_not_pairs_is_refused():
  src = MaskedDocs([np.arange(3, 8)] * 3, [np.ones(5, np.uint8)] * 3)
  with pytest.raises(pairs_lib.NotPreferenceDataError, match="holds 3 documents"):
    pairs_lib.pack_pairs(src, seq_len=64, special_tokens=SpecialTokens(bos_id=BOS, eos_id=EOS))
  other = MaskedDocs([np.arange(3, 8), np.arange(4, 9)],
                     [np.array([0, 0, 1, 1, 1], np.uint8)] * 2)
  with pytest.raises(pairs_lib.NotPreferenceDataError, match="different prompts"):
    pairs_lib.pack_pairs(other, seq_len=64,
                         special_tokens=SpecialTokens(bos_id=BOS, eos_id=EOS))


def test_a_chat_dataset_that_looks_like_pairs_is_refused_for_not_being_written_as_pairs(
    tmp_path, model):
  """Two SFT conversations with the same question and different answers: as documents 0 and 1
  they begin with the same prompt and hold trained tokens, so only the manifest can tell that
  the dataset was not written as preference pairs (`segpack tokenize --format preference`)."""
  question = {"role": "user", "content": "What does zip do?"}
  chats = [[question, {"role": "assistant", "content": answer}]
           for answer in ("It pairs items.", "It compresses files.")]
  chat_files.write_chat_dataset(((f"c{i}", c) for i, c in enumerate(chats)), tmp_path / "sft",
                                encoder=chat.ChatEncoder(spm.SpmTokenizer(model)))
  source = shards.ShardSource(tmp_path / "sft")
  assert source.has_loss_mask and len(source) == 2
  with pytest.raises(pairs_lib.NotPreferenceDataError, match="not written as preference pairs"):
    pairs_lib.pack_pairs(source, seq_len=128)

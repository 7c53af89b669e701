"""A mixture epoch's draw (`segpack.data.mixture_draw`) against the draw as it was before
(`segpack.bench.mixture_baseline.draw_before`, the documented rule with a fresh permutation per
cycle): the same documents the same number of times, so the same token shares and repetition
bounds, and the last cycle's documents in the same order; only the whole cycles' order differs,
and each of those is a permutation of the source."""

import collections
import json

import numpy as np
import pytest

from segpack.bench import packing as packing_bench
from segpack.bench.mixture_baseline import draw_before
from segpack.bench.packing_mixture import mixture_sources
from segpack.data import mixture_draw
from segpack.data.mixture import Mixture, MixtureDraws, MixtureSource


def _draws(num_docs, *, seed, tokens_per_epoch=None, weights=(0.5, 0.3, 0.2)):
  sources = mixture_sources(num_docs, sigma=1.0, seed=seed)
  mixture = Mixture(sources=tuple(MixtureSource(name=f"s{i}", source=s, weight=w)
                                  for i, (s, w) in enumerate(zip(sources, weights))),
                    tokens_per_epoch=tokens_per_epoch)
  return MixtureDraws(mixture, seed=seed), sources


def _segments(documents, source):
  keep = documents.parent_index == source
  return documents.parent_ids[keep], documents.lengths[keep]


@pytest.mark.parametrize("num_docs,seed,tokens_per_epoch", [
    (1, 0, None), (7, 1, None), (50, 2, None), (4096, 3, None), (5000, 4, None),
    (9000, 5, None), (5000, 6, 10**6), (3000, 7, 3 * 10**7)])
def test_the_draw_gives_the_old_draws_documents(num_docs, seed, tokens_per_epoch):
  draws, sources = _draws(num_docs, seed=seed, tokens_per_epoch=tokens_per_epoch)
  for epoch in range(3):
    new, old = draws.draw(epoch), draw_before(draws, epoch)
    assert np.array_equal(new.tokens, old.tokens)
    assert np.allclose(new.tokens / new.tokens.sum(), old.tokens / old.tokens.sum(),
                       rtol=0, atol=1e-5)
    assert np.array_equal(new.min_repeats, old.min_repeats)
    assert np.array_equal(new.max_repeats, old.max_repeats)
    assert len(new.documents) == len(old.documents)
    docs = new.documents
    assert (docs.parent_ids.dtype, docs.parent_index.dtype, docs.lengths.dtype) == (
        np.int32, np.uint8, np.int32)
    for i, source in enumerate(sources):
      ids, lengths = _segments(docs, i)
      old_ids, _ = _segments(old.documents, i)
      assert np.array_equal(lengths, source.lengths[ids])  # the lengths of the documents drawn
      counts = collections.Counter(ids.tolist())
      assert counts == collections.Counter(old_ids.tolist())
      every = [counts.get(d, 0) for d in range(num_docs)]
      assert max(every) - min(every) <= 1
      assert (min(every), max(every)) == (new.min_repeats[i], new.max_repeats[i])
      full = int(new.max_repeats[i]) - 1  # whole cycles; the last one is drawn once more
      # The last cycle: the same documents in the same order; each whole cycle: all of them.
      assert np.array_equal(ids[full * num_docs:], old_ids[full * num_docs:])
      for c in range(full):
        cycle = ids[c * num_docs:(c + 1) * num_docs]
        assert np.array_equal(np.sort(cycle), np.arange(num_docs))


def test_whole_cycles_meet_other_neighbours():
  draws, _ = _draws(20_000, seed=0, weights=(0.8, 0.1, 0.1))
  ids, _ = _segments(draws.draw(0).documents, 0)
  n = 20_000
  cycles = [ids[c * n:(c + 1) * n] for c in range(3)]
  pairs = [set(zip(c[:-1].tolist(), c[1:].tolist())) for c in cycles]
  assert len(pairs[0] & pairs[1]) < 50 and len(pairs[1] & pairs[2]) < 50
  assert not np.array_equal(cycles[0], cycles[1])


@pytest.mark.parametrize("n", [0, 1, 5, 4097, 100_000])
def test_permutation_is_numpys(n):
  assert np.array_equal(mixture_draw.permutation(n, [3, 1, 4, 1]),
                        np.random.default_rng([3, 1, 4, 1]).permutation(n))


def test_cycles_subtract_as_the_rule_says():
  assert mixture_draw.cycles(10, 25.5) == (2, 5.5)
  assert mixture_draw.cycles(10, 30.0) == (2, 10.0)  # the last cycle may take every document
  assert mixture_draw.cycles(10, 3.0) == (0, 3.0)


def test_bench_mixture_before_and_after(capsys):
  assert packing_bench.main(["--sections", "mixture", "--mixture-docs", "3000",
                             "--mixture-grain-docs", "0", "--mixture-before", "--json"]) == 0
  now, before = json.loads(capsys.readouterr().out)["results"]
  assert (now["case"], before["case"]) == ("segpack draw + ffd", "before: draw + ffd")
  assert now["realized_tokens"] == before["realized_tokens"] and now["rows"] == before["rows"]
  assert now["drawn_documents"] == before["drawn_documents"]
  for r in (now, before):
    assert r["draw_peak_rss"] >= r["input_rss"] and r["plan_peak_rss"] > 0
    assert r["draw_bytes_per_drawn_doc"] >= 0 and r["bytes_per_doc"] > 0
  assert packing_bench.main(["--sections", "mixture", "--mixture-docs", "300",
                             "--mixture-grain-docs", "0", "--mixture-before"]) == 0
  out = capsys.readouterr().out
  assert "before: draw + ffd" in out and "the draw's peak" in out

"""The `mixture` section of `segpack bench packing` at a tiny size: segpack's token shares are the
weights, Grain's are reported beside them, and the section runs only when asked for."""

import json

import numpy as np
import pytest

from segpack.bench import packing as bench
from segpack.bench import packing_mixture


def test_mixture_section_at_a_tiny_size(capsys):
  assert bench.main(["--sections", "mixture", "--mixture-docs", "2000",
                     "--mixture-grain-docs", "500", "--seq-len", "4096", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  small, grain, full = out["results"]
  assert [r["section"] for r in out["results"]] == ["mixture"] * 3
  assert [r["documents"] for r in out["results"]] == [1500, 1500, 6000]
  weights = packing_mixture.MIXTURE_WEIGHTS
  for r in (small, full):
    assert r["case"] == "segpack draw + ffd" and r["dropped"] == 0
    assert r["shares"] == pytest.approx(weights, rel=0.01)
    assert sum(r["realized_tokens"]) == r["tokens"]
    # Every token of the sources is drawn once on average: the budget is their sum.
    assert r["tokens"] >= sum(r["source_tokens"])
    assert r["rows"] >= r["lower_bound"] and 0.99 < r["utilization"] <= 1.0
    assert r["seconds"] == pytest.approx(r["draw_seconds"] + r["plan_seconds"])
    assert r["peak_rss"] >= r["input_rss"] > 0 and r["peak_bytes_per_doc"] > 0
    # The short source repeats, the long one gives a part of its documents.
    assert r["min_repeats"][0] >= 4 and r["max_repeats"][2] <= 1
  assert grain["case"] == "Grain mix + FirstFitPack" and grain["mixed_documents"] == 1000
  assert sum(grain["shares"]) == pytest.approx(1.0)
  assert len(grain["shares"]) == len(grain["mix_shares"]) == 3
  # Grain's weights are shares of the documents: the long source takes most of the tokens.
  assert grain["mix_shares"][2] > 0.4 and grain["shares"][2] > weights[2] + 0.1
  assert grain["rows"] >= grain["lower_bound"] and grain["tokens_per_s"] > 0
  assert grain["tokens"] + grain["truncated_tokens"] <= sum(grain["source_tokens"])


def test_mixture_section_text_and_default_skip(capsys):
  assert bench.main(["--sections", "mixture", "--mixture-docs", "300",
                     "--mixture-grain-docs", "0"]) == 0
  out = capsys.readouterr().out
  assert "segpack draw + ffd" in out and "Grain" not in out
  assert "token shares" in out and "peak RSS of a fresh process" in out
  # Without --sections the section needs --mixture-docs: only the named sections run here.
  assert bench.main(["--num-docs", "0", "--grain-docs", "0", "--load-docs", "0", "--builtin",
                     "none", "--balance-docs", "0", "--repack-docs", "0", "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["results"] == []


def test_synthetic_source_documents_carry_the_source():
  (a, b, c) = packing_mixture.mixture_sources(50, sigma=0.5)
  assert np.array_equal(a[3], np.full(a.lengths[3], 1, np.int32)) and set(c[0].tolist()) == {3}
  assert len(b) == 50 and abs(c.lengths.mean() / a.lengths.mean() - 10) < 3

"""`segpack stats --data "a=DIR:0.7,b=DIR:0.3"`: per-source figures of mixture epoch 0's draw and
its whole plan, checked against the datasets' lengths, the draw written out naively and
`segpack.packing.plan`; every bad entry is one line on stderr and exit code 2."""

import json
import re

import numpy as np
import pytest

import segpack
from segpack import packing
from support.stats_data import run, two_datasets, write_docs  # noqa: F401 (a fixture)


def naive_draw(lengths, target, *, seed, epoch, source):
  """The documents one source gives in an epoch, one at a time (`Mixture`'s algorithm)."""
  drawn, total, cycle = [], 0, 0
  while total < target:
    for d in np.random.default_rng([seed, epoch, source, cycle]).permutation(len(lengths)):
      if total >= target:
        break
      drawn.append(int(d))
      total += int(lengths[d])
    cycle += 1
  return drawn


@pytest.mark.parametrize("tokens_per_epoch", [None, 9000])
def test_mixture_figures_match_an_independent_computation(two, tokens_per_epoch, capsys):
  root, lengths = two
  data = f"web={root / 'web'}:0.7,code={root / 'code'}:0.3"
  extra = [] if tokens_per_epoch is None else ["--tokens-per-epoch", str(tokens_per_epoch)]
  rc, out, err = run(["--data", data, "--seq-len", "512", "--json", *extra], capsys)
  assert rc == 0, err
  stats = json.loads(out)
  total = sum(int(n.sum()) for n in lengths.values())
  budget = total if tokens_per_epoch is None else tokens_per_epoch
  assert stats["tokens_per_epoch"] == budget
  drawn_lengths, realized = [], []
  for i, (row, (name, n), weight) in enumerate(zip(stats["sources"], lengths.items(),
                                                   (0.7, 0.3))):
    drawn = naive_draw(n, weight * budget, seed=0, epoch=0, source=i)
    counts = np.bincount(drawn, minlength=len(n))
    drawn_lengths.append(n[drawn])
    realized.append(int(n[drawn].sum()))
    assert row["name"] == name and row["documents"] == len(n) and row["tokens"] == n.sum()
    assert row["weight"] == pytest.approx(weight)
    assert row["target_tokens"] == pytest.approx(weight * budget)
    assert row["realized_tokens"] == realized[-1] and row["drawn_documents"] == len(drawn)
    # A source gives its target and at most one document more.
    assert weight * budget <= realized[-1] < weight * budget + n.max()
    assert (row["min_repeats"], row["max_repeats"]) == (counts.min(), counts.max())
  for row, tokens in zip(stats["sources"], realized):
    assert row["realized_share"] == pytest.approx(tokens / sum(realized))
  expected = packing.plan(np.concatenate(drawn_lengths), 512, strategy="ffd", extra_tokens=2)
  plan = stats["plan"]
  assert plan["documents"] == sum(len(d) for d in drawn_lengths)
  assert plan["rows"] == expected.num_rows
  assert plan["utilization"] == pytest.approx(expected.stats["utilization"])
  assert plan["tokens"] == sum(int(d.sum()) for d in drawn_lengths) + 2 * plan["documents"]


@pytest.mark.parametrize("seed", [0, 5])
def test_mixture_epoch_0_is_the_one_pack_dataset_reads(two, seed, capsys):
  """stats plans the mixture epoch by pack_dataset's own route: the same rows and slots."""
  root, _ = two
  data = f"web={root / 'web'}:0.7,code={root / 'code'}:0.3"
  rc, out, err = run(["--data", data, "--seq-len", "512", "--seed", str(seed), "--json"], capsys)
  assert rc == 0, err
  rows = segpack.pack_dataset(segpack.Mixture.parse(data), seq_len=512, seed=seed, shuffle=False)
  assert json.loads(out)["plan"]["rows"] == rows.rows_in_epoch(0)
  built = rows.get_batch(np.arange(rows.rows_in_epoch(0)))
  assert json.loads(out)["plan"]["tokens"] == int((built["segment_ids"] != 0).sum())


def test_mixture_text_table_and_strategy(two, capsys):
  root, lengths = two
  data = f"web={root / 'web'}:3,code={root / 'code'}:1"  # weights 0.75 / 0.25 once normalized
  rc, out, err = run(["--data", data, "--seq-len", "256", "--strategy", "bfd"], capsys)
  assert rc == 0, err
  rc, js, _ = run(["--data", data, "--seq-len", "256", "--strategy", "bfd", "--json"], capsys)
  stats = json.loads(js)
  assert out.startswith("mixture of 2 sources: epoch 0's draw (seed 0), "
                        f"{sum(int(n.sum()) for n in lengths.values()):,} tokens per epoch\n")
  for row in stats["sources"]:
    line = re.search(rf"^  {row['name']}\s+(.*)$", out, re.M).group(1).split()
    assert line == [f"{row['documents']:,}", f"{row['tokens']:,}", f"{row['weight']:.4f}",
                    f"{row['target_tokens']:,.1f}", f"{row['realized_tokens']:,}",
                    f"{row['realized_share']:.6f}",
                    f"{row['min_repeats']}-{row['max_repeats']}"]
  assert [r["weight"] for r in stats["sources"]] == pytest.approx([0.75, 0.25])
  assert "strategy bfd, seq_len 256" in out and stats["plan"]["strategy"] == "bfd"
  rows = re.search(r"^\s+rows\s+([\d,]+)", out, re.M).group(1)
  assert int(rows.replace(",", "")) == stats["plan"]["rows"]


def test_one_dataset_keeps_the_plain_output(two, capsys):
  root, lengths = two
  rc, out, err = run(["--data", str(root / "web"), "--seq-len", "512", "--json"], capsys)
  assert rc == 0, err
  row = json.loads(out)
  assert row["documents"] == len(lengths["web"]) and "sources" not in row
  # `name=path` is a mixture of one: every document once.
  rc, out, err = run(["--data", f"w={root / 'web'}", "--seq-len", "512", "--json"], capsys)
  assert rc == 0, err
  (source,) = json.loads(out)["sources"]
  assert source["realized_share"] == 1.0 and source["min_repeats"] == source["max_repeats"] == 1


@pytest.mark.parametrize("entry,flags,message", [
    ("web={web}:abc,code={code}:0.3", [], "the weight 'abc' is not a number"),
    ("web={web}:-0.5,code={code}:0.3", [], "mixture source 'web' needs a positive weight"),
    ("web={web}:0.7,code={root}/missing:0.3", [], "is not a dataset"),
    ("web={web}:0.7,other={other}:0.3", [], "were tokenized differently"),
    ("web={web}:0.7,web={code}:0.3", [], "mixture source name 'web' is used twice"),
    ("web={web}:0.7,code={code}:0.3", ["--tokens-per-epoch", "0"],
     "--tokens-per-epoch must be a positive number of tokens, got 0"),
    ("web={web}:0.7,code={code}:0.3", ["--save-plan"], "--save-plan applies to one dataset"),
    ("web={web}:0.7,code={code}:0.3", ["--compare"], "--compare applies to one dataset"),
    ("{web}", ["--tokens-per-epoch", "100"], "--tokens-per-epoch=100 applies to a mixture"),
])
def test_bad_mixture_is_one_line_and_exit_2(two, entry, flags, message, capsys):
  root, _ = two
  write_docs(root / "other", [5, 6], value=30, fingerprint="another-tokenizer")
  data = entry.format(web=root / "web", code=root / "code", other=root / "other", root=root)
  rc, out, err = run(["--data", data, *flags], capsys)
  assert rc == 2 and out == ""
  assert err.startswith("segpack stats: error: ") and err.count("\n") == 1, err
  assert message in err

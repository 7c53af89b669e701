"""Data arguments read silently wrong (issue "silent round 2", classes 1 and 2): a weight left
off, a path holding ':' or '=', weights that overflow or are not positive numbers.

The one rule is `segpack.data.mixture.parse_data`; the trainer's `data.train` and
`segpack stats --data` both use it. Oracles: every token of a dataset is its own tag (VALUE of
the dataset), so the rows say which dataset they came from without the pipeline, and the token
counts of the datasets are the lengths the test wrote.
"""

import json
import os
import re

import numpy as np
import pytest

import segpack
from segpack import shards
from segpack.cli import main as cli_main
from segpack.data.mixture import Mixture
from train import data_sources as data_sources
from train import data as data_lib
from support import data_configs  # noqa: E402

BOS, EOS = 1, 2


def write(path, lengths, value):
  """A dataset at `path` whose every token is `value`, one document per length."""
  with shards.ShardWriter(str(path), vocab_size=100, tokenizer_fingerprint="round2",
                          metadata={"tokenizer": {"bos_id": BOS, "eos_id": EOS}}) as w:
    for n in lengths:
      w.write(np.full(int(n), value, dtype=np.int32))
  return int(np.sum(lengths))


def spec(train, **kw):
  return data_configs.builtin_data_config(seq_len=32, train=train, **kw)


def make(train, **kw):
  return data_lib.make_data(spec(train, **kw), batch_size=4, process_index=0, process_count=1)


def values_trained(data, steps=6):
  """The dataset tags found in the first training batches."""
  found = set()
  for k in range(steps):
    ids = data.train[k]["input_ids"]
    found |= set(ids[ids > EOS].tolist())
  return found


def stats(argv, capsys):
  rc = cli_main.main(["stats", *argv])
  out = capsys.readouterr()
  return rc, out.out, out.err


@pytest.fixture(name="root")
def datasets(tmp_path):
  rng = np.random.default_rng(0)
  for value, name in enumerate(("kernel", "man", "ds", "ds:2", "run:v2", "lr=3"), start=10):
    write(tmp_path / name, rng.integers(3, 30, size=40), value)
  return tmp_path


# Class 1: a weight left off used to mean 1 (and then `m` got 58.8% of the tokens).

def test_a_weight_on_some_entries_only_is_one_line_naming_the_bare_entry(root, capsys):
  text = f"k={root / 'kernel'}:0.7,m={root / 'man'}"
  with pytest.raises(segpack.PipelineConfigError,
                     match=f"entry 'm={root / 'man'}' has no weight but 'k=.*:0.7' has one"):
    Mixture.parse(text)
  with pytest.raises(data_sources.DataConfigError, match="'m=.*man' has no weight"):
    make(text)
  rc, out, err = stats(["--data", text], capsys)
  assert rc == 2 and out == "" and err.count("\n") == 1 and "'m=" in err and "no weight" in err


def test_no_weights_mean_equal_token_shares_and_the_log_says_so(root, capsys):
  text = f"k={root / 'kernel'},m={root / 'man'}"
  data = make(text)
  assert "(mixture: equal token shares)" in data.description
  assert values_trained(data) == {10, 11}
  weighted = make(f"k={root / 'kernel'}:3,m={root / 'man'}:1")
  assert "(mixture: k 75.0%, m 25.0%)" in weighted.description
  rc, out, err = stats(["--data", text, "--json", "--seq-len", "64"], capsys)
  assert rc == 0, err
  got = json.loads(out)
  tokens = [s["tokens"] for s in got["sources"]]
  lengths = {name: np.fromfile(root / name / "shard-00000.offsets", "<i8")[-1]
             for name in ("kernel", "man")}
  assert tokens == [lengths["kernel"], lengths["man"]]  # the oracle: what the test wrote
  half = (lengths["kernel"] + lengths["man"]) / 2
  for s in got["sources"]:
    assert s["weight"] == 0.5 and half <= s["realized_tokens"] < half + 30


# Class 2: a path holding ':' was read as a weight.

def test_a_spelling_that_reads_two_ways_is_refused_naming_both(root, capsys):
  text = str(root / "ds:2")  # the dataset ds:2, or ds with weight 2: both exist
  with pytest.raises(data_sources.DataConfigError) as e:
    make(text)
  message = str(e.value)
  assert "\n" not in message
  assert f"the dataset '{root / 'ds:2'}'" in message
  assert f"the dataset '{root / 'ds'}' with weight 2" in message
  rc, out, err = stats(["--data", text], capsys)
  assert rc == 2 and out == "" and err.count("\n") == 1 and "reads 2 ways" in err
  # Each reading has a spelling of its own.
  assert values_trained(make(f"{root / 'ds:2'}/")) == {13}
  assert values_trained(make(f"{root / 'ds'}/:2")) == {12}


def test_an_existing_path_with_a_colon_or_an_equals_sign_is_one_dataset(root, capsys):
  for name, value in (("run:v2", 14), ("lr=3", 15)):
    data = make(str(root / name))
    assert values_trained(data) == {value} and "mixture" not in data.description
    rc, out, err = stats(["--data", str(root / name), "--json", "--seq-len", "64"], capsys)
    assert rc == 0, err
    assert json.loads(out)["documents"] == 40 and "sources" not in json.loads(out)
  # Inside a mixture too: the entry's path exists, so ':v2' is no weight.
  mixed = make(f"a={root / 'run:v2'},b={root / 'kernel'}")
  assert values_trained(mixed) == {14, 10}


def test_only_the_colon_spelling_exists_trains_on_it(tmp_path, capsys):
  write(tmp_path / "only:2", [5, 6, 7], 20)  # no dataset `only`
  assert values_trained(make(str(tmp_path / "only:2"))) == {20}
  rc, out, err = stats(["--data", str(tmp_path / "only:2"), "--json"], capsys)
  assert rc == 0 and json.loads(out)["documents"] == 3, err


@pytest.mark.parametrize("weights, match", [
    (("1e308", "1e308"), "weights sum to infinity"),
    (("nan", "1"), "'k' needs a positive weight, got nan"),
    (("inf", "1"), "'k' needs a positive weight, got inf"),
    (("0", "1"), "'k' needs a positive weight, got 0.0"),
    (("-1", "1"), "'k' needs a positive weight, got -1.0"),
    (("v2", "1"), "the weight 'v2' is not a number, and '.*kernel:v2' is no existing path"),
])
def test_bad_weights_are_refused_by_name_when_parsed(root, weights, match, capsys):
  text = f"k={root / 'kernel'}:{weights[0]},m={root / 'man'}:{weights[1]}"
  with pytest.raises(segpack.PipelineConfigError, match=f"mixture entry 'k=.*kernel:.*{match}"):
    Mixture.parse(text)
  with pytest.raises(data_sources.DataConfigError, match=match):
    make(text)
  rc, out, err = stats(["--data", text], capsys)
  assert rc == 2 and out == "" and err.count("\n") == 1 and "'k=" in err


def test_a_mixture_built_in_code_with_overflowing_weights_is_refused(root):
  mixture = Mixture(sources=(
      segpack.MixtureSource(name="k", source=str(root / "kernel"), weight=1e308),
      segpack.MixtureSource(name="m", source=str(root / "man"), weight=1e308)))
  with pytest.raises(segpack.PipelineConfigError, match=r"weights \[1e\+308, 1e\+308\] sum to "
                     "infinity"):
    segpack.pack_dataset(mixture, seq_len=32)


@pytest.mark.parametrize("text", [
    "{r}/kernel", "{r}/ds:2/", "{r}/ds/:2", "{r}/run:v2", "{r}/lr=3", "k={r}/kernel",
    "k={r}/kernel:1,m={r}/man:2", "k={r}/kernel,m={r}/man", "{r}/ds:2", "{r}/missing:0.5",
    "k={r}/kernel:0.7,m={r}/man", "{r}/kernel:nan",
])
def test_the_trainer_and_stats_read_every_spelling_alike(root, text, capsys):
  text = text.format(r=root)
  try:
    trainer = "mixture" if make(text).source_names else "one"
  except data_sources.DataConfigError:
    trainer = "error"
  rc, out, _ = stats(["--data", text, "--json", "--seq-len", "64"], capsys)
  cli = "error" if rc else "mixture" if "sources" in json.loads(out) else "one"
  assert trainer == cli


# Property: whatever paths exist and however entries are spelled, a data argument is read one way
# or refused; never silently another way. Paths are built from segments holding the characters
# the rule reads ('=', ':', ','), so spellings collide often.
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from segpack.data.mixture import parse_data  # noqa: E402
from segpack.data.options import PipelineConfigError  # noqa: E402

_SEGMENTS = ["a", "b", "a:2", "b:v2", "n=a", "a,b", "c:0.5", "d:1e308"]
_PATH = st.lists(st.sampled_from(_SEGMENTS), min_size=1, max_size=2).map(lambda p: "D/" + "/".join(p))
_ENTRY = st.tuples(st.sampled_from(["", "web=", "n="]), _PATH,
                   st.sampled_from(["", ":2", ":0.5", ":v2", ":0", ":1e308"]))


def _norm(path):
  return os.path.normpath(path.strip())


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(existing=st.sets(_PATH, max_size=6), entries=st.lists(_ENTRY, min_size=1, max_size=3))
@example(existing={"D/a"}, entries=[("web=", "D/a:2/a", "")])  # ':2/a' is no weight
def test_property_a_data_argument_reads_one_way_or_is_refused(existing, entries):
  fs = {_norm(p) for p in existing}
  exists = lambda p: _norm(p) in fs  # noqa: E731
  text = ",".join("".join(e) for e in entries)
  try:
    got = parse_data(text, exists=exists)
  except PipelineConfigError as e:
    message = str(e)
    if " ways: " in message:  # refused as ambiguous: each suggested spelling reads one way
      suggested = re.findall(r"'([^']*)'", message.rsplit("; write ", 1)[1])
      assert len(suggested) >= 2, message
      readings = []
      for spelling in suggested:
        try:
          readings.append(parse_data(spelling, exists=exists))
        except PipelineConfigError:  # a weight the suggestion keeps may be refused on its own
          readings.append("refused")
      assert len({repr(r) for r in readings}) == len(readings), (message, readings)
    return
  if exists(text):  # an existing path is a path, read as one dataset
    assert got is None, (text, got)
    return
  if got is None:  # one entry without a name or weight: that path, existing or not
    assert len(entries) == 1
    return
  weights = [m.weight for m in got.sources]
  assert all(0 < w < float("inf") for w in weights)
  spelled = [re.search(r":[^/:]+$", "".join(e)) for e in entries]  # a weight's spelling
  assert len(set(weights)) == 1 or all(spelled)  # all weights or none
  if any("," in "".join(e) for e in entries):
    return  # a ',' inside a path: entries and sources need not pair up
  assert len(got.sources) == len(entries)
  for m, entry in zip(got.sources, entries):
    whole = "".join(entry)
    # A naive oracle of the readings: the whole text, after the first '=', and each of those
    # before its last ':' when what follows could be a weight (no '/').
    paths = {whole, whole.partition("=")[2] or whole}
    for text_ in list(paths):
      head, colon, tail = text_.rpartition(":")
      if colon and tail.strip() and "/" not in tail:
        paths.add(head)
    if any(p and exists(p) for p in paths):  # some reading names a dataset: that one is read
      assert exists(m.source), (text, m)

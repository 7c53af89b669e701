"""`segpack stats` on a mixture: a negative seed and a token budget no machine could draw end in
one line naming the flag and the value (exit code 2), before any work; so does the trainer."""

import time

import pytest

from segpack import PipelineConfigError
from segpack.data import mixture as mixture_lib
from support.stats_data import run, two_datasets  # noqa: F401 (a fixture)


def test_a_negative_seed_is_one_line(two, capsys):
  root, _ = two
  rc, _, err = run(["--data", f"web={root / 'web'}:0.7,code={root / 'code'}:0.3", "--seed", "-1",
                    "--seq-len", "512"], capsys)
  assert rc == 2 and len(err.strip().splitlines()) == 1
  assert "--seed must be an int >= 0" in err and "-1" in err


def test_a_budget_beyond_memory_is_refused_at_once(two, capsys):
  root, _ = two
  start = time.perf_counter()
  rc, _, err = run(["--data", f"web={root / 'web'}:0.7,code={root / 'code'}:0.3",
                    "--tokens-per-epoch", str(10**15), "--seq-len", "512"], capsys)
  assert rc == 2 and len(err.strip().splitlines()) == 1, err
  assert "tokens_per_epoch=1,000,000,000,000,000 draws about" in err and "GiB" in err
  assert time.perf_counter() - start < 20  # refused before drawing, not after a MemoryError


def test_the_library_refuses_both_too(two):
  root, _ = two
  mixture = mixture_lib.Mixture.parse(f"a={root / 'web'}:1,b={root / 'code'}:1",
                                      tokens_per_epoch=10**15)
  with pytest.raises(PipelineConfigError, match="more than this machine's"):
    mixture_lib.MixtureDraws(mixture, seed=0)
  fine = mixture_lib.Mixture.parse(f"a={root / 'web'}:1,b={root / 'code'}:1")
  with pytest.raises(PipelineConfigError, match="seed must be an int >= 0, got -3"):
    mixture_lib.MixtureDraws(fine, seed=-3)
  assert mixture_lib.MixtureDraws(fine, seed=0).tokens_per_epoch > 0

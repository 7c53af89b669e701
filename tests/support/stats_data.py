"""Two shard datasets of one tokenizer and the `segpack stats` runner, shared by the stats tests."""

import numpy as np
import pytest

from segpack.cli import main as cli_main
from segpack.shards import ShardWriter


def write_docs(path, lengths, *, value, fingerprint="mix-test"):
  """A shard dataset whose every token is `value`, one document per length."""
  with ShardWriter(str(path), vocab_size=1000, tokenizer_fingerprint=fingerprint,
                   shard_tokens=4000, metadata={"bos_id": 1, "eos_id": 2}) as w:
    for n in lengths:
      w.write(np.full(int(n), value, dtype=np.int32))


@pytest.fixture(name="two")
def two_datasets(tmp_path):
  """Two datasets of one tokenizer: `web` (many short documents), `code` (fewer, longer)."""
  rng = np.random.default_rng(3)
  lengths = {"web": rng.integers(1, 120, 400), "code": rng.integers(50, 700, 60)}
  for value, (name, n) in enumerate(lengths.items(), start=10):
    write_docs(tmp_path / name, n, value=value)
  return tmp_path, lengths


def run(argv, capsys):
  rc = cli_main.main(["stats", *argv])
  out = capsys.readouterr()
  return rc, out.out, out.err

"""Test setup: force 8 CPU devices before JAX is imported anywhere; the small built-in corpus's
fixtures shared by the tokenizer tests."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402  (imports after the device flags)

from support import small_corpus  # noqa: E402


@pytest.fixture(scope="session")
def model(tmp_path_factory):
  """The small built-in corpus's SentencePiece model file (a module may define its own)."""
  return small_corpus.spm_model(tmp_path_factory)


@pytest.fixture(scope="session")
def texts():
  """The first 120 documents of the small built-in corpus's train split."""
  return small_corpus.train_texts()

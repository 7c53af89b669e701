"""Test setup: force 8 CPU devices before JAX is imported anywhere; one XLA compilation cache for
the whole run; the small built-in corpus's fixtures shared by the tokenizer tests.

The compilation cache: the first process of a run (pytest itself, or the xdist controller, before
it starts its workers) makes a fresh temporary directory and names it in
`JAX_COMPILATION_CACHE_DIR`, which the workers and every command a test runs (`python -m
train.main ...`) inherit, so that a program compiled once (the smoke model's step, the attention
kernels in interpret mode) is read back by the next process instead of compiled again. The
directory is removed when the run ends; a `JAX_COMPILATION_CACHE_DIR` set by the caller is used
as it is and kept.
"""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
  # The tests' programs are tiny: LLVM's optimizations of the CPU code cost far more than they
  # save (about half of a trainer test's time is compiling). XLA's HLO passes (fusion, buffer
  # assignment, what the memory tests read) run as before; the commands the tests start inherit
  # it. Set JAX_DISABLE_MOST_OPTIMIZATIONS=0 to compile as a user's CPU run does.
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  # XLA's CPU code generation for the same reason: the older fusion emitters, and each
  # program's LLVM module in one piece instead of split for parallel compiling, compile a test
  # file such as tests/train/test_model.py in about half the CPU time (the same HLO: results
  # differ by float rounding at most). XLA_FLAGS that set them already are kept.
  if "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += (" --xla_cpu_use_fusion_emitters=false"
                                " --xla_cpu_parallel_codegen_split_count=1")
_OWN_XLA_CACHE = None
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_XLA_CACHE = tempfile.mkdtemp(prefix="segpack-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_XLA_CACHE
  # every program, the small ones too (orbax's, a step's helpers): reading one back is cheaper
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402  (imports after the device flags)
from absl import logging as absl_logging  # noqa: E402

from support import file_order, small_corpus  # noqa: E402


@pytest.fixture(scope="session")
def model(tmp_path_factory):
  """The small built-in corpus's SentencePiece model file (a module may define its own)."""
  return small_corpus.spm_model(tmp_path_factory)


@pytest.fixture(scope="session")
def texts():
  """The first 120 documents of the small built-in corpus's train split."""
  return small_corpus.train_texts()


_ABSL_VERBOSITY = absl_logging.get_verbosity()  # the process's own, before any command ran


@pytest.fixture(autouse=True)
def _absl_verbosity():
  """Sets absl's verbosity to the process's own before each test and after it: a command run
  in-process (`train.export` sets ERROR), in a test or in a shared fixture set up just before
  this test, must not hide the warnings a test of the same worker reads."""
  absl_logging.set_verbosity(_ABSL_VERBOSITY)
  yield
  absl_logging.set_verbosity(_ABSL_VERBOSITY)


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  """Removes the compilation cache this run made (not one the caller named)."""
  if _OWN_XLA_CACHE is not None:
    shutil.rmtree(_OWN_XLA_CACHE, ignore_errors=True)


def pytest_configure(config):
  """pytest-xdist's loadfile mode would reorder the files by how many tests each holds (its
  `--no-loadscope-reorder` turns that off); the order of pytest_collection_modifyitems is kept.
  Without pytest-xdist there is no such option, and nothing to turn off."""
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  """Longest files first, so that CI's two loadfile workers end together (support.file_order)."""
  file_order.order_longest_first(items, file_order.recorded_seconds())


def pytest_runtest_logreport(report):
  file_order.record(report)


def pytest_sessionfinish(session):
  if not hasattr(session.config, "workerinput"):  # the controller, or a run without workers
    file_order.write_recorded()

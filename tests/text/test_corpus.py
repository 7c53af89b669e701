"""The built-in corpus (segpack/text/corpus.py); SentencePiece itself is in
tests/text/tokenizers/test_spm.py."""

import argparse
import ast
import gc
import inspect
import sys

import pytest

from segpack.text import corpus
from segpack.text.tokenizers import spm
from segpack.shards import ShardSource


@pytest.fixture(scope="session")
def small(tmp_path_factory):
  """The small built-in corpus, built once per test session in a temporary cache."""
  cache = tmp_path_factory.getbasetemp() / "segpack-cache"
  return corpus.ensure_builtin(size="small", cache_dir=cache, workers=1), cache


def test_documents_are_deterministic_unique_and_non_empty():
  first = list(corpus.builtin_documents(split="train", size="small"))
  second = list(corpus.builtin_documents(split="train", size="small"))
  assert first == second
  names = [n for n, _ in first]
  assert len(set(names)) == len(names)
  assert all(t.strip() for _, t in first)
  kinds = {n.split(":")[0] for n in names}
  assert kinds == {"topic", "doc", "source"}


def _top_level_docstring_names(rel, text):
  """Names of the docstring documents of a module's top level (an independent oracle)."""
  module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
  tree = ast.parse(text)
  names = [f"doc:{module}"] if (ast.get_docstring(tree) or "").strip() else []
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and (
        ast.get_docstring(node) or "").strip():
      names.append(f"doc:{module}.{node.name}")
  return names


def test_full_corpus_split_is_by_module_and_about_two_percent():
  train = dict(corpus.builtin_documents(split="train"))
  held = dict(corpus.builtin_documents(split="eval"))
  assert not set(train) & set(held)
  held_sources = [n for n in held if n.startswith("source:")]
  assert held_sources
  for name in held_sources:  # A module's docstrings follow its source into the held-out split.
    for doc_name in _top_level_docstring_names(name[7:], held[name]):
      assert doc_name in held and doc_name not in train
  for name in [n for n in train if n.startswith("source:")][:50]:
    for doc_name in _top_level_docstring_names(name[7:], train[name]):
      assert doc_name in train
  share = len(held) / (len(held) + len(train))
  assert 0.005 < share < 0.06, share
  assert sum(len(t) for t in train.values()) > 5_000_000  # Megabytes of real docs and code.
  assert "topic:if" in train or "topic:if" in held
  assert not any("site-packages" in n or "/test/" in n for n in train)
  assert "source:pydoc_data/topics.py" not in train  # Already there as the topics.


def test_docstrings_match_ast_of_the_source():
  docs = dict(corpus.builtin_documents(split="train", size="small"))
  source_name = next(n for n in docs if n.startswith("source:") and not n.endswith("__init__.py"))
  rel = source_name.split(":", 1)[1]
  module = rel.removesuffix(".py").replace("/", ".")
  tree = ast.parse(docs[source_name])
  expected = []
  if ast.get_docstring(tree):
    expected.append(module)
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and \
        ast.get_docstring(node) and ast.get_docstring(node).strip():
      expected.append(f"{module}.{node.name}")
  got = [n[4:] for n in docs if n.startswith(f"doc:{module}.") or n == f"doc:{module}"]
  assert set(expected) <= set(got)
  for qual in expected:
    node_doc = docs[f"doc:{qual}"]
    assert node_doc.startswith(qual + "\n\n")


def test_bad_split_or_size():
  with pytest.raises(ValueError, match="split must be one of .* got 'test'"):
    next(corpus.builtin_documents(split="test"))
  with pytest.raises(ValueError, match="size must be one of .* got 'huge'"):
    next(corpus.builtin_documents(split="train", size="huge"))


def test_small_builtin_round_trips_every_document(small):
  built, _ = small
  tok = spm.SpmTokenizer(built.spm_model)
  assert built.vocab_size == tok.vocab_size == corpus.SIZES["small"]
  for split, path in (("train", built.train_dir), ("eval", built.eval_dir)):
    src = ShardSource(path)
    src.verify()
    assert src.tokenizer_fingerprint == tok.fingerprint
    docs = list(corpus.builtin_documents(split=split, size="small"))
    assert len(src) == len(docs) > 0
    for i, (name, text) in enumerate(docs):
      # The only normalisation left: U+2581 decodes as a space.
      assert tok.decode(src[i]) == text.replace("\u2581", " "), name


def test_ensure_builtin_reuses_the_cache(small):
  built, cache = small
  stamp = (built.train_dir / "manifest.json").stat().st_mtime_ns
  again = corpus.ensure_builtin(size="small", cache_dir=cache, workers=1)
  assert again == built
  assert (built.train_dir / "manifest.json").stat().st_mtime_ns == stamp


def test_first_build_says_what_it_does_and_a_cached_corpus_is_silent(tmp_path, capfd):
  """The first run of the main command builds the corpus for minutes: it must not be silent."""
  corpus.ensure_builtin(size="small", cache_dir=tmp_path, workers=1, progress=True)
  err = capfd.readouterr().err
  stages = ["building the built-in corpus (small", "training a SentencePiece model (2048 pieces)",
            "trained the SentencePiece model in", "tokenized the train split:",
            "tokenized the eval split:"]
  at = [err.find(stage) for stage in stages]
  assert all(i >= 0 for i in at) and at == sorted(at), err
  corpus.ensure_builtin(size="small", cache_dir=tmp_path, workers=1, progress=True)
  assert capfd.readouterr().err == ""


def test_ensure_builtin_rebuilds_a_damaged_cache(small):
  built, cache = small
  (built.eval_dir / "shard-00000.tokens").unlink()
  again = corpus.ensure_builtin(size="small", cache_dir=cache, workers=1)
  assert again == built
  ShardSource(built.eval_dir).verify()


class _NestedParse:
  """A garbage-collector callback that parses a snippet during the next `times` collections,
  as a traceback printed from such a callback does on CPython 3.11: the nested parse leaves the
  outer one's AST depth counter off (python/cpython#106905)."""

  def __init__(self, times):
    self.times = times

  def __call__(self, phase, info):
    caller = sys._getframe(1).f_code  # the Python frame the collection interrupted
    if phase == "start" and self.times > 0 and caller is ast.parse.__code__:
      self.times -= 1
      ast.parse("x = (1)")

  def __enter__(self):
    self._threshold = gc.get_threshold()
    gc.callbacks.append(self)
    gc.set_threshold(1)  # a collection on nearly every allocation: the parse is interrupted
    return self

  def __exit__(self, *exc):
    gc.set_threshold(*self._threshold)
    gc.callbacks.remove(self)


def test_a_parse_interrupted_by_a_nested_one_is_retried_and_gives_the_same_tree():
  text = inspect.getsource(argparse)
  with _NestedParse(times=1) as nested:
    tree = corpus._parse(text, filename="argparse.py")
    assert nested.times == 0  # it did interrupt the parse
  assert ast.dump(tree) == ast.dump(ast.parse(text))
  if sys.version_info[:2] == (3, 11):  # negative control: plain ast.parse fails there
    with _NestedParse(times=1), pytest.raises(SystemError, match="recursion depth mismatch"):
      ast.parse(text)


def test_a_parse_that_keeps_failing_is_raised_not_skipped(monkeypatch):
  calls = []

  def failing(*args, **kwargs):
    calls.append(args)
    raise SystemError("AST constructor recursion depth mismatch (before=9, after=17)")

  monkeypatch.setattr(corpus.ast, "parse", failing)
  with pytest.raises(SystemError, match="recursion depth mismatch"):
    corpus._parse("x = 1", filename="x.py")
  assert len(calls) == 2

"""The built-in corpus: the running Python's own documentation and standard-library sources.

Every Python install ships a few tens of megabytes of real English prose and real code, so segpack
can tokenize, pack and train out of the box with no download. The corpus has three kinds of
documents, all read statically (nothing from the standard library is imported except
`pydoc_data.topics`, a plain dict, so no module with import side effects ever runs):

* `topic:<name>`: the pydoc help topics (`pydoc_data.topics.topics`), e.g. the language reference
  pages shown by `help("if")`;
* `doc:<module>.<qualname>`: one document per module, class and function docstring, found by parsing
  the source with `ast` (the text is the qualified name, a blank line and the cleaned docstring);
* `source:<relative path>`: the text of each standard-library `.py` file.

Kept out: `site-packages`, the test suites (`test/`, `tests/`, `idle_test/`: a lot of
machine-generated data and deliberately odd encodings, about two thirds of the bytes),
`__pycache__`, and `pydoc_data/topics.py` (its text already is the topic documents).

Order is deterministic for a given Python install: topics sorted by name, then the modules sorted
by relative path, each one's docstrings in source order followed by its source. The held-out split
is by *group*, so that no text of an evaluation document leaks into training through a copy: a
module's docstrings and its source share the module's group, and each topic is its own group. A
group is held out when the first 8 bytes of the SHA-256 of its name, as an integer modulo 1000, are
below `EVAL_PER_MILLE` (about 2%).

`ensure_builtin` tokenizes both splits with a SentencePiece model trained on the training split and
caches the result (see `segpack.text.tokenizers.spm` for the cache and the tokenizer).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
import tokenize
from collections.abc import Iterator
from pathlib import Path

from pydoc_data import topics as pydoc_topics

from segpack import files
from segpack import shards as shards_lib
from segpack.errors import ArgumentError
from segpack.text import encode
from segpack.text.inputs import InputFormatError
from segpack.text.tokenizers import cache as tokenizer_cache
from segpack.text.tokenizers import spm as spm_lib

__all__ = [
    "BuiltinDataset",
    "CORPUS_VERSION",
    "EVAL_PER_MILLE",
    "SIZES",
    "builtin_documents",
    "builtin_dir",
    "builtin_tokenizer",
    "damaged",
    "ensure_builtin",
    "is_eval_group",
]

_LOG = logging.getLogger(__name__)

# Bump when the document set or texts change: part of the cache key.
CORPUS_VERSION = 2
# Held-out share of groups, in thousandths.
EVAL_PER_MILLE = 20
# Vocabulary size per corpus size.
SIZES = {"full": 8192, "small": 2048}
# `size="small"` keeps the modules whose group hash modulo this is 0 (plus all topics).
_SMALL_MODULO = 10
# Bump when the cached built-in shards change (not the model): a cache with another layout is
# re-tokenized (seconds), keeping its SentencePiece model (minutes).
_BUILTIN_LAYOUT = 2
_SPLITS = ("train", "eval")
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
_SKIP_FILES = frozenset({"pydoc_data/topics.py"})


@dataclasses.dataclass(frozen=True)
class BuiltinDataset:
  """A tokenized built-in corpus in the cache.

  Attributes:
    train_dir: shard dataset of the training split (open with `segpack.ShardSource`).
    eval_dir: shard dataset of the held-out split.
    spm_model: the SentencePiece model both were tokenized with.
    vocab_size: its vocabulary size.
  """

  train_dir: Path
  eval_dir: Path
  spm_model: Path
  vocab_size: int


def _hash_int(name: str) -> int:
  return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def is_eval_group(group: str) -> bool:
  """Whether the documents of `group` belong to the held-out split."""
  return _hash_int(group) % 1000 < EVAL_PER_MILLE


def stdlib_dir() -> Path:
  """The directory of the running Python's pure-Python standard library."""
  return Path(sysconfig.get_paths()["stdlib"])


def _module_files(root: Path) -> list[Path]:
  """Sorted relative paths of the corpus's `.py` files under `root`."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
    for filename in filenames:
      if filename.endswith(".py"):
        rel = (Path(dirpath) / filename).relative_to(root)
        if rel.as_posix() not in _SKIP_FILES:
          found.append(rel)
  return sorted(found, key=lambda p: p.as_posix())


def _module_name(rel: Path) -> str:
  parts = list(rel.with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _docstrings(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
  """Yields (qualified name, cleaned docstring) for the module and its classes and functions."""
  stack: list[tuple[ast.AST, str]] = [(tree, module)]
  while stack:
    node, qualname = stack.pop()
    doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
    if doc and doc.strip():
      yield qualname, doc
    children = [
        child for child in ast.iter_child_nodes(node)
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    # Reversed so that the stack pops them in source order.
    stack.extend((child, f"{qualname}.{child.name}") for child in reversed(children))


def _read_source(path: Path) -> str | None:
  """The text of a Python file, honouring its coding cookie; None when it does not decode."""
  try:
    with tokenize.open(path) as f:
      return f.read()
  except (SyntaxError, UnicodeDecodeError, LookupError):
    return None


def _parse(text: str, *, filename: str, attempts: int = 2) -> ast.Module | None:
  """`ast.parse`, None for a file that does not parse.

  CPython 3.11 can fail a valid parse with `SystemError: AST constructor recursion depth
  mismatch` when an exception interrupts an earlier AST construction (an exception raised in a
  garbage-collector callback, say) and leaves the interpreter's depth counter off
  (python/cpython#106905). The parse itself is deterministic, so it is tried again; a second
  failure is raised, never skipped, because the corpus must not depend on it.
  """
  for attempt in range(attempts):
    try:
      return ast.parse(text, filename=filename)
    except (SyntaxError, ValueError):
      return None
    except SystemError:
      if attempt + 1 == attempts:
        raise
  return None


def _module_documents(root: Path, rel: Path) -> Iterator[tuple[str, str]]:
  text = _read_source(root / rel)
  if text is None:
    return
  module = _module_name(rel)
  tree = _parse(text, filename=str(root / rel))
  if tree is not None:
    for qualname, doc in _docstrings(tree, module):
      yield f"doc:{qualname}", f"{qualname}\n\n{doc}"
  if text.strip():  # Empty `__init__.py` files are no documents.
    yield f"source:{rel.as_posix()}", text


def _topics() -> dict[str, str]:
  return pydoc_topics.topics


def builtin_documents(*, split: str, size: str = "full") -> Iterator[tuple[str, str]]:
  """The documents of one split of the built-in corpus, in deterministic order.

  Args:
    split: "train" or "eval" (the held-out groups, about 2%).
    size: "full" (every module, about 14 MB of text) or "small" (all topics and about a tenth of
      the modules, about 1.3 MB).

  Yields:
    (name, text) pairs; names are unique, texts are non-empty.

  Raises:
    ValueError: for an unknown `split` or `size`.
  """
  if split not in _SPLITS:
    raise ArgumentError(f"builtin_documents: split must be one of {_SPLITS}, got {split!r}")
  if size not in SIZES:
    raise ArgumentError(f"builtin_documents: size must be one of {sorted(SIZES)}, got {size!r}")
  want_eval = split == "eval"
  topics = _topics()
  for key in sorted(topics):
    text = topics[key]
    if text.strip() and is_eval_group(f"topic:{key}") == want_eval:
      yield f"topic:{key}", text
  root = stdlib_dir()
  for rel in _module_files(root):
    group = f"module:{rel.as_posix()}"
    if size == "small" and _hash_int(group + ":small") % _SMALL_MODULO:
      continue
    if is_eval_group(group) != want_eval:
      continue
    yield from _module_documents(root, rel)


def corpus_key(size: str) -> str:
  """A short hash naming this Python's built-in corpus of `size` (keys the cache)."""
  ident = f"{CORPUS_VERSION}|{size}|{SIZES.get(size)}|{sys.version}|{stdlib_dir()}"
  return hashlib.sha256(ident.encode("utf-8")).hexdigest()[:16]


def builtin_dir(*, size: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
  """The cache directory of the built-in corpus of `size` for this Python."""
  if size not in SIZES:
    raise InputFormatError(f"built-in corpus size must be one of {sorted(SIZES)}, got "
                           f"{size!r}")
  return spm_lib.cache_root(cache_dir) / f"builtin-{size}-{corpus_key(size)}"


def builtin_tokenizer(*, size: str, cache_dir: str | os.PathLike[str] | None = None,
                      progress: bool = False) -> spm_lib.SpmTokenizer:
  """The cached SentencePiece model of the built-in corpus, trained on first use."""
  root = builtin_dir(size=size, cache_dir=cache_dir)
  with files.file_lock(root / ".lock"):
    texts = (t for _, t in builtin_documents(split="train", size=size))
    return tokenizer_cache.trained_tokenizer(
        texts, root / "spm.model", vocab_size=SIZES[size], key={"builtin": corpus_key(size)},
        progress=progress)


def builtin_splits(output: Path, size: str, tokenizer: spm_lib.SpmTokenizer, *, workers: int,
                   shard_tokens: int, progress: bool, overwrite: bool) -> list[encode.Summary]:
  """Tokenizes both splits of the built-in corpus into `output/train` and `output/eval`."""
  summaries = []
  for split in ("train", "eval"):
    start = time.perf_counter()
    key = encode.resume_key({"builtin": corpus_key(size), "split": split,
                             "tokenizer": tokenizer.fingerprint, "shard_tokens": shard_tokens,
                             "layout": _BUILTIN_LAYOUT})
    manifest, resumed, nbytes = encode.write_dataset(
        (text for _, text in builtin_documents(split=split, size=size)), output / split,
        tokenizer=tokenizer, resume_key=key, workers=workers, shard_tokens=shard_tokens,
        metadata={"source": f"builtin:{size}", "split": split, "python": sys.version},
        progress=progress, overwrite=overwrite)
    summaries.append(encode.summarize(output / split, manifest, resumed=resumed, bad_lines=0,
                                      seconds=time.perf_counter() - start, text_bytes=nbytes))
    encode.say(progress, f"tokenized the {split} split: {manifest['num_documents']:,} "
                         f"documents, {manifest['num_tokens']:,} tokens in "
                         f"{time.perf_counter() - start:.1f} s")
  return summaries


def damaged(path: Path) -> str | None:
  """Why the cached dataset at `path` fails the checks of every dataset the trainer opens
  (`ShardSource(path)`: the structure, each file's SHA-256 once per machine, the token ids
  against `vocab_size`), or None when it passes. The built-in corpora rebuild a damaged cache."""
  try:
    shards_lib.ShardSource(path)
  except shards_lib.ShardFormatError as e:
    return str(e)
  return None


def _intact(root: Path) -> bool:
  """Whether both cached splits pass `damaged`'s checks and have the current layout."""
  try:
    done = json.loads((root / "complete.json").read_text("utf-8"))
    if not isinstance(done, dict) or done.get("layout") != _BUILTIN_LAYOUT:
      _LOG.warning("cached built-in corpus %s has an older layout; re-tokenizing it", root)
      return False
  except (OSError, ValueError):
    return False
  for split in _SPLITS:
    problem = damaged(root / split)
    if problem is not None:
      _LOG.warning("cached built-in corpus %s is damaged (%s); re-tokenizing it", root, problem)
      return False
  return True


def ensure_builtin(
    *,
    size: str = "full",
    cache_dir: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    progress: bool = False,
) -> BuiltinDataset:
  """Returns the tokenized built-in corpus, building and caching it on first use.

  The first call trains a SentencePiece model (`SIZES[size]` pieces) on the training split and
  tokenizes both splits into shard datasets; later calls (also from other processes, which wait
  on a lock while one builds) return the cached result.

  Args:
    size: "full" (vocabulary 8192, a few minutes on 2 cores) or "small" (vocabulary 2048, a few
      seconds; for tests and smoke runs).
    cache_dir: cache root; default: `$SEGPACK_CACHE`, else `~/.cache/segpack`.
    workers: tokenizer processes; default: the number of CPUs.
    progress: when the corpus has to be built, say on stderr what is being done (reading,
      training the tokenizer, tokenizing each split), with progress bars on a terminal. A cached
      corpus prints nothing.

  Returns:
    The dataset directories, the model and its vocabulary size.
  """
  root = builtin_dir(size=size, cache_dir=cache_dir)
  if progress and not (root / "complete.json").exists():
    encode.say(True, f"building the built-in corpus ({size}: this Python's docs and "
                     f"standard-library sources) into {root}; first use only, later runs read "
                     f"the cache")
  tokenizer = builtin_tokenizer(size=size, cache_dir=cache_dir, progress=progress)
  with files.file_lock(root / ".lock"):
    if (root / "complete.json").exists() and not _intact(root):
      for path in (root / "complete.json", root / "train" / shards_lib.MANIFEST_NAME,
                   root / "eval" / shards_lib.MANIFEST_NAME):
        path.unlink(missing_ok=True)
    if not (root / "complete.json").exists():
      workers = workers or os.cpu_count() or 1
      encode.say(progress, f"tokenizing the train and eval splits with {workers} worker processes")
      builtin_splits(root, size, tokenizer, workers=workers,
                     shard_tokens=encode.DEFAULT_SHARD_TOKENS, progress=progress, overwrite=True)
      files.atomic_write_json(root / "complete.json", {"fingerprint": tokenizer.fingerprint,
                                                       "layout": _BUILTIN_LAYOUT})
  return BuiltinDataset(train_dir=root / "train", eval_dir=root / "eval",
                        spm_model=root / "spm.model", vocab_size=tokenizer.vocab_size)

"""The built-in chat corpus: deterministic question/answer conversations about Python's own docs.

Made from the documents of the built-in corpus (`segpack.text.corpus`) with no download and no
model:
the user asks about a function, class, module or help topic, and the assistant answers with its
documentation. The held-out split is the built-in corpus's (by module / topic group), so no
answer of an evaluation conversation appears in training.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from segpack import files
from segpack import shards
from segpack.errors import ArgumentError
from segpack.shards.format import read_manifest
from segpack.text import chat
from segpack.text import corpus
from segpack.text.chat import files as chat_files
from segpack.text.tokenizers import spm

__all__ = ["BuiltinChatDataset", "CHAT_CORPUS_VERSION", "builtin_conversations",
           "ensure_builtin_chat"]

_LOG = logging.getLogger(__name__)

# Bump when the conversations change: part of the cache key.
CHAT_CORPUS_VERSION = 1
# Answers are cut (at a line end) to about this many characters.
MAX_ANSWER_CHARS = 2400
_SYSTEM = (
    "You are a concise assistant that answers questions about the Python standard library.",
    "Answer with the relevant Python documentation.",
    "You explain Python APIs by quoting their documentation.",
)
_ASK_FUNCTION = ("What does `{name}` do?", "Explain `{name}`.", "How do I use `{name}`?",
                 "Can you show me the documentation of `{name}`?")
_ASK_MODULE = ("What is the `{name}` module for?", "Describe the module `{name}`.")
_ASK_TOPIC = ("What does the Python documentation say about {name!r}?",
              "Tell me about the help topic {name!r}.")
_FOLLOW_UP = ("And `{name}`?", "What about `{name}`?", "Now explain `{name}` too.")


@dataclasses.dataclass(frozen=True)
class BuiltinChatDataset:
  """A tokenized built-in chat corpus in the cache.

  Attributes:
    train_dir: shard dataset (with a loss mask) of the training conversations.
    eval_dir: shard dataset of the held-out conversations.
    spm_model: the chat SentencePiece model (the built-in corpus's training text plus the chat
      markers as user-defined symbols).
    vocab_size: its vocabulary size.
    train_jsonl: the training conversations as JSONL (`{"messages": [...]}` per line).
    eval_jsonl: the held-out conversations as JSONL.
  """

  train_dir: Path
  eval_dir: Path
  spm_model: Path
  vocab_size: int
  train_jsonl: Path
  eval_jsonl: Path


def _pick(name: str, salt: str, n: int) -> int:
  digest = hashlib.sha256(f"{salt}|{name}".encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "little") % n


def _answer(text: str) -> str:
  if len(text) <= MAX_ANSWER_CHARS:
    return text
  cut = text.rfind("\n", 0, MAX_ANSWER_CHARS)
  return text[:cut if cut > 0 else MAX_ANSWER_CHARS].rstrip()


def _question(kind: str, name: str) -> str:
  choices = {"topic": _ASK_TOPIC, "module": _ASK_MODULE}.get(kind, _ASK_FUNCTION)
  return choices[_pick(name, "ask", len(choices))].format(name=name)


def _conversation(items: list[tuple[str, str, str]]) -> dict[str, Any]:
  """One conversation from (kind, name, answer) items: the first is asked, the rest follow up."""
  messages = []
  first = items[0][1]
  if _pick(first, "system", 3) == 0:
    messages.append({"role": "system", "content": _SYSTEM[_pick(first, "which", len(_SYSTEM))]})
  for k, (kind, name, answer) in enumerate(items):
    ask = _question(kind, name) if k == 0 else _FOLLOW_UP[_pick(name, "follow", 3)].format(
        name=name)
    messages += [{"role": "user", "content": ask},
                 {"role": "assistant", "content": _answer(answer)}]
  return {"messages": messages}


def _module_items(docs: list[tuple[str, str]]) -> Iterator[dict[str, Any]]:
  """Conversations over one module's docstrings: about a quarter of them run 2 or 3 turns."""
  i = 0
  while i < len(docs):
    name = docs[i][0]
    turns = 1 + (_pick(name, "turns", 8) if _pick(name, "multi", 4) == 0 else 0) % 3
    group = docs[i:i + turns]
    is_module = i == 0 and len(docs) > 1 and all(n.startswith(name + ".") for n, _ in docs[1:])
    kind = "module" if is_module else "function"
    yield _conversation([(kind if k == 0 else "function", n, a) for k, (n, a) in enumerate(group)])
    i += len(group)


def builtin_conversations(*, split: str, size: str = "full") -> Iterator[dict[str, Any]]:
  """The conversations of one split, in a deterministic order.

  Every help topic gives one conversation ("What does the Python documentation say about
  'if'?" answered by the topic text); every module's docstrings, in source order, give
  conversations of 1 to 3 question/answer turns (follow-ups ask about the next function). A third
  of the conversations (by a hash of the first name) open with a system message. Answers are cut
  at a line end after about `MAX_ANSWER_CHARS` characters.

  Args:
    split: "train" or "eval" (the built-in corpus's held-out groups).
    size: "full" or "small", as for `segpack.text.corpus.builtin_documents`.

  Yields:
    `{"messages": [...]}` objects.
  """
  module_docs: list[tuple[str, str]] = []
  for doc_name, text in corpus.builtin_documents(split=split, size=size):
    kind, _, name = doc_name.partition(":")
    if kind == "topic":
      yield _conversation([("topic", name, text.strip())])
    elif kind == "doc":
      qualname, _, body = text.partition("\n\n")
      if body.strip():
        module_docs.append((qualname, body.strip()))
    elif kind == "source":  # A module's docstrings precede its source.
      yield from _module_items(module_docs)
      module_docs = []
  yield from _module_items(module_docs)


def _cache_key(size: str) -> str:
  ident = (f"{CHAT_CORPUS_VERSION}|{corpus.corpus_key(size)}|"
           f"{json.dumps(dataclasses.asdict(chat.DEFAULT_TEMPLATE), sort_keys=True)}")
  return hashlib.sha256(ident.encode("utf-8")).hexdigest()[:16]


def chat_tokenizer(*, size: str, cache_dir: str | os.PathLike[str] | None = None):
  """The chat SentencePiece model, trained on first use and cached.

  It is trained on the same text as the built-in corpus's model, with the default template's
  markers as user-defined symbols (one token each); the built-in model is left as it is (and its
  cache untouched), so plain-text datasets keep their tokens.
  """
  root = _root(size, cache_dir)
  model_file = root / "spm.model"
  record = root / "spm.json"
  with files.file_lock(root / ".lock"):
    if model_file.exists() and record.exists():
      try:
        if json.loads(record.read_text("utf-8")).get("key") == _cache_key(size):
          return spm.SpmTokenizer(model_file)
      except ValueError:
        pass
    texts = (t for _, t in corpus.builtin_documents(split="train", size=size))
    tok = spm.train_spm(texts, model_file, vocab_size=corpus.SIZES[size],
                        user_defined_symbols=list(chat.DEFAULT_TEMPLATE.markers))
    files.atomic_write_json(record, {"key": _cache_key(size), "fingerprint": tok.fingerprint})
    return tok


def _root(size: str, cache_dir: str | os.PathLike[str] | None) -> Path:
  if size not in corpus.SIZES:
    raise ArgumentError(f"ensure_builtin_chat: size must be one of {sorted(corpus.SIZES)}, got "
                     f"{size!r}")
  return spm.cache_root(cache_dir) / f"builtin-chat-{size}-{_cache_key(size)}"


def _cached(out: Path, key: str) -> bool:
  """Whether `out` holds the finished split of `key` and passes `corpus.damaged`'s checks (the
  ones of every dataset the trainer opens); a damaged one loses its manifest, to be rebuilt."""
  manifest = out / shards.MANIFEST_NAME
  if not manifest.exists():
    return False
  try:
    if read_manifest(manifest).get("resume_key") != key:
      return False
  except (shards.ShardFormatError, AttributeError):
    return False
  problem = corpus.damaged(out)
  if problem is None:
    return True
  _LOG.warning("cached built-in chat corpus %s is damaged (%s); re-tokenizing it", out, problem)
  manifest.unlink()
  return False


def ensure_builtin_chat(
    *,
    size: str = "small",
    train_on: str = "assistant",
    cache_dir: str | os.PathLike[str] | None = None,
) -> BuiltinChatDataset:
  """Returns the tokenized built-in chat corpus, building and caching it on first use.

  Args:
    size: "small" (default; vocabulary 2048, seconds to build) or "full" (8192, minutes).
    train_on: "assistant", "last_assistant" or "all": which tokens the loss mask trains (each
      value is cached in its own pair of datasets).
    cache_dir: cache root; default `$SEGPACK_CACHE`, else `~/.cache/segpack`.

  Returns:
    The dataset directories, the chat model and the JSONL files.
  """
  root = _root(size, cache_dir)
  tok = chat_tokenizer(size=size, cache_dir=cache_dir)
  encoder = chat.ChatEncoder(tok, train_on=train_on, strict_markers=True)
  dirs = {}
  with files.file_lock(root / ".lock"):
    for split in ("train", "eval"):
      jsonl = root / f"{split}.jsonl"
      if not jsonl.exists():
        lines = [json.dumps(c, ensure_ascii=False)
                 for c in builtin_conversations(split=split, size=size)]
        files.atomic_write_bytes(jsonl, ("\n".join(lines) + "\n").encode("utf-8"))
      out = root / f"{split}-{train_on}"
      key = f"{_cache_key(size)}|{tok.fingerprint}|{train_on}|{split}"
      if not _cached(out, key):
        chat_files.write_chat_dataset(
            chat_files.read_conversations(jsonl), out, encoder=encoder, resume_key=key,
            metadata={"source": f"builtin-chat:{size}", "split": split, "python": sys.version})
      dirs[split] = out
  return BuiltinChatDataset(train_dir=dirs["train"], eval_dir=dirs["eval"], spm_model=root /
                            "spm.model", vocab_size=tok.vocab_size,
                            train_jsonl=root / "train.jsonl", eval_jsonl=root / "eval.jsonl")

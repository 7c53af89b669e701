"""`segpack bench chat-turns`: the cost of storing chat one sample per assistant turn.

    segpack bench chat-turns --tokenizer hf:DIR [--template FILE ...] [--input FILE.jsonl]
                             [--limit 300] [--json]   # or python -m segpack.bench.chat_turns

A chat template is prefix-stable for a conversation when rendering more messages only appends
text; then the conversation stored once trains every assistant turn as the model sees it when it
answers. Where it is not (Qwen3 writes an empty think block into the last assistant turn only),
`segpack tokenize --turns auto` stores one sample per assistant turn instead
(`segpack.text.chat.hf_chat.HfChatTemplate`). This benchmark counts the tokens that costs. They are
counts, not times: the same on every machine for the same tokenizer, template and data.

Algorithm, for each template (the tokenizer directory's own, or each `--template` instead):
  1. Conversations: the records of `--input` (`{"messages": [...]}`, with `tools` when offered),
     or else the built-in chat corpus's small training conversations regrouped: their
     user/assistant turns in order, cut into conversations of `--turns-min` to `--turns-max`
     turns (each count drawn from a hash of the conversation's index), a conversation opening
     with the system message of its first turn's source when that has one. The first `--limit`.
  2. Auto: `HfChatTemplate(options=ChatOptions(turns="auto"))` encodes each conversation:
     `whole` is the tokens of the conversation rendered once, `auto` the tokens it stores,
     `expanded` the conversations it stores one sample per assistant turn.
  3. Expand: the tokens stored with `turns="expand"` (one sample per assistant turn, always).
  4. Naive bound: for each assistant message `k`, the tokens of transformers'
     `apply_chat_template(messages[:k+1], tools=tools)`: the turn's sample `prompt + turn` where
     the template renders the history alike with or without the turn. Summed: what storing every
     prefix ending in an assistant turn costs, counted by transformers alone (not from segpack's
     samples).
  5. Ratios: `auto`, `expand` and `naive` over `whole`. A conversation that segpack refuses
     (`ChatFormatError`, with either setting) is counted in `skipped` and left out of every sum.

Example (tokens of a byte-level BPE of 404 tokens): user "Hi", assistant "Hello", user "Bye",
assistant "Ok". Qwen3 renders the whole conversation in 49 tokens, but its render of
`messages[:2]` writes `<think>\\n\\n</think>\\n\\n` before "Hello" and the whole does not, so
"auto" expands it: a sample of 28 tokens for turn 1 and one of 49 for turn 3 (the last turn's
sample is the whole conversation), auto = expand = 77, ratio 1.57; the naive bound, the lengths of
`messages[:2]` and `messages[:4]`, is 28 + 49 = 77 as well. Qwen2.5's template is prefix-stable
here: "auto" keeps the whole 101 tokens (ratio 1.0), where "expand" and the naive bound cost
80 + 101 = 181 (1.79).

Where a template renders the history alike in every prefix (Qwen3 and Qwen2.5 do), "expand" costs
exactly the naive bound, and "auto" is below it only by the conversations it keeps whole (for
Qwen3: one user question answered over several assistant turns that all carry reasoning, as in
tool use).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Sequence

from segpack import errors
from segpack.bench import tables
from segpack.text.chat import ChatFormatError, Conversation
from segpack.text.chat import corpus as chat_corpus
from segpack.text.chat import files as chat_files
from segpack.text.chat.hf_chat import ChatOptions, HfChatTemplate
from segpack.text.chat.hf_chat.messages import validate_tools
from segpack.text.tokenizers import spec as tokenizer_spec

__all__ = ["builtin_turn_conversations", "format_table", "main", "measure_template"]

# (column, JSON key, format, width) of the table, after the template's name.
_COLUMNS = (("convs", "conversations", "{:d}", 6), ("expanded", "expanded", "{:d}", 8),
            ("whole", "whole_tokens", "{:,d}", 10), ("auto", "auto_tokens", "{:,d}", 10),
            ("expand", "expand_tokens", "{:,d}", 10), ("naive", "naive_tokens", "{:,d}", 10),
            ("auto/whole", "auto_ratio", "{:.3f}", 10),
            ("expand/whole", "expand_ratio", "{:.3f}", 12),
            ("naive/whole", "naive_ratio", "{:.3f}", 11), ("skipped", "skipped", "{:d}", 7))


def _pick(index: int, choices: int) -> int:
  digest = hashlib.sha256(f"chat-turns|{index}".encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "little") % choices


def _turns_of(records: Iterable[dict[str, Any]]) -> Iterator[tuple[dict | None, dict, dict]]:
  """`(system message or None, user, assistant)` of every user/assistant turn, in order (the
  system message on the first turn of its conversation only)."""
  for record in records:
    messages = record["messages"]
    system = messages[0] if messages[0]["role"] == "system" else None
    body = messages[1:] if system is not None else messages
    for i in range(0, len(body) - 1, 2):
      if body[i]["role"] == "user" and body[i + 1]["role"] == "assistant":
        yield (system if i == 0 else None), body[i], body[i + 1]


def builtin_turn_conversations(*, turns_min: int = 3, turns_max: int = 6,
                               limit: int | None = None) -> list[dict[str, Any]]:
  """The built-in chat corpus's small training conversations regrouped into conversations of
  `turns_min` to `turns_max` user/assistant turns (step 1 of the module's algorithm).

  Args:
    turns_min: the fewest user/assistant turns of a conversation.
    turns_max: the most.
    limit: at most this many conversations (None: all; the last turns, too few, are dropped).

  Returns:
    `{"messages": [...]}` records, the same on every run.
  """
  if not 1 <= turns_min <= turns_max:
    raise errors.ArgumentError(f"need 1 <= turns_min <= turns_max, got turns_min={turns_min}, "
                               f"turns_max={turns_max}")
  turns = list(_turns_of(chat_corpus.builtin_conversations(split="train", size="small")))
  out: list[dict[str, Any]] = []
  at = 0
  while limit is None or len(out) < limit:
    group = turns[at:at + turns_min + _pick(len(out), turns_max - turns_min + 1)]
    if len(group) < turns_min:
      break
    messages = [group[0][0]] if group[0][0] is not None else []
    for _, user, assistant in group:
      messages += [user, assistant]
    out.append({"messages": messages})
    at += len(group)
  return out


@dataclasses.dataclass
class _Sums:
  """The counts of one template, summed over the conversations it encodes."""

  conversations: int = 0
  turns: int = 0
  expanded: int = 0
  whole_tokens: int = 0
  auto_tokens: int = 0
  expand_tokens: int = 0
  naive_tokens: int = 0
  skipped: int = 0
  first_skipped: str | None = None


class _NaiveCounter:
  """Step 4: token counts of transformers' `apply_chat_template` alone."""

  def __init__(self, directory: Path, *, template_file: str | None, renderer: HfChatTemplate):
    import transformers  # optional: segpack[hf], as HfChatTemplate needs it
    self._hf = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if template_file is not None:
      self._hf.chat_template = Path(template_file).read_text("utf-8")
    self._renderer = renderer  # for the recorded date only (`today`, `kwargs`)
    self.vocab_size = len(self._hf)

  def count(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """The summed tokens of `messages[:k+1]` for every assistant message `k`."""
    total = 0
    with self._renderer.today():
      for k, message in enumerate(messages):
        if message.get("role") == "assistant":
          out = self._hf.apply_chat_template(messages[:k + 1], tokenize=True, return_dict=True,
                                             **self._renderer.kwargs(tools))
          total += len(out["input_ids"])
    return total


def _parts(conversation: Any, *, where: str) -> tuple[Any, list[dict[str, Any]] | None]:
  if isinstance(conversation, Conversation):
    return conversation.messages, validate_tools(conversation.tools, where=where)
  return conversation, None


def measure_template(directory: str | Path, conversations: Sequence[tuple[str, Any]], *,
                     template_file: str | None = None) -> dict[str, Any]:
  """One template's record (steps 2 to 5 of the module's algorithm).

  Args:
    directory: the Hugging Face tokenizer directory.
    conversations: `(where, messages or chat.Conversation)` pairs.
    template_file: a Jinja template rendering instead of the directory's own (None: its own).

  Returns:
    The JSON record: the template, the tokenizer's vocabulary size, the counts and the ratios.
  """
  auto = HfChatTemplate(directory, options=ChatOptions(turns="auto", template_file=template_file))
  expand = HfChatTemplate(directory,
                          options=ChatOptions(turns="expand", template_file=template_file))
  naive = _NaiveCounter(Path(directory), template_file=template_file, renderer=auto)
  sums = _Sums()
  for where, conversation in conversations:
    try:
      kept = auto.encode_conversation(conversation, where=where)
      stored = expand.encode_conversation(conversation, where=where)
      messages, tools = _parts(conversation, where=where)
    except ChatFormatError as e:
      sums.skipped += 1
      sums.first_skipped = sums.first_skipped or errors.one_line(e)
      continue
    sums.conversations += 1
    sums.turns += len(stored.samples)
    sums.expanded += int(kept.expanded)
    sums.whole_tokens += kept.whole_tokens
    sums.auto_tokens += kept.stored_tokens
    sums.expand_tokens += stored.stored_tokens
    sums.naive_tokens += naive.count(messages, tools)
  whole = max(sums.whole_tokens, 1)
  return {"template": Path(template_file).name if template_file else "own",
          "tokenizer": str(directory), "vocab_size": naive.vocab_size, **dataclasses.asdict(sums),
          "auto_ratio": sums.auto_tokens / whole, "expand_ratio": sums.expand_tokens / whole,
          "naive_ratio": sums.naive_tokens / whole}


def format_table(results: list[dict[str, Any]], *, data: str = "") -> str:
  """The records as a table (one row per template), then the tokenizer and the data."""
  width = max([8] + [len(r["template"]) for r in results])
  head = f"{'template':<{width}} " + " ".join(f"{c:>{w}}" for c, _, _, w in _COLUMNS)
  rows = [f"{r['template']:<{width}} " + " ".join(f"{fmt.format(r[k]):>{w}}"
                                                 for _, k, fmt, w in _COLUMNS) for r in results]
  notes = []
  if results:
    notes.append(f"tokenizer {results[0]['tokenizer']} ({results[0]['vocab_size']:,} tokens); "
                 f"{data}".rstrip("; "))
  notes += [f"{r['template']}: first skipped: {r['first_skipped']}" for r in results
            if r["first_skipped"]]
  return "\n".join([tables.table(head, rows), *notes])


def _directory(spec: str) -> Path:
  """The directory of `--tokenizer hf:DIR`."""
  kind, path = tokenizer_spec.split_spec(spec)
  if kind != "hf" or not Path(path).is_dir():
    raise errors.UsageError(f"--tokenizer {spec!r}: expected hf:DIR, a Hugging Face tokenizer "
                            f"directory (holding a chat template unless --template is given)")
  return Path(path)


def _file(text: str) -> str:
  if not Path(text).is_file():
    raise argparse.ArgumentTypeError(f"{text!r} is not a file")
  return text


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="segpack bench chat-turns", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tokenizer", required=True, metavar="hf:DIR",
                  help="a Hugging Face tokenizer directory holding a chat template")
  ap.add_argument("--template", type=_file, action="append", default=None, metavar="FILE",
                  help="render with this Jinja chat template instead (repeatable: one row each)")
  ap.add_argument("--input", type=_file, default=None, metavar="FILE.jsonl",
                  help="chat records (default: the built-in chat corpus, regrouped)")
  ap.add_argument("--limit", type=errors.at_least(1), default=300, help="conversations (300)")
  ap.add_argument("--turns-min", type=errors.at_least(1), default=3,
                  help="built-in data: the fewest user/assistant turns of a conversation (3)")
  ap.add_argument("--turns-max", type=errors.at_least(1), default=6,
                  help="built-in data: the most (6)")
  ap.add_argument("--json", action="store_true", help="one JSON record per template, one a line")
  return ap


def _conversations(args: argparse.Namespace) -> tuple[list[tuple[str, Any]], str]:
  """`(where, conversation)` pairs of the command line's data, and a line naming it."""
  if args.input is not None:
    pairs = []
    for pair in chat_files.read_conversations(args.input):
      if len(pairs) == args.limit:
        break
      pairs.append(pair)
    return pairs, f"{len(pairs)} conversations of {args.input}"
  if args.turns_min > args.turns_max:
    raise errors.UsageError(f"--turns-min {args.turns_min} is above --turns-max "
                            f"{args.turns_max}")
  records = builtin_turn_conversations(turns_min=args.turns_min, turns_max=args.turns_max,
                                       limit=args.limit)
  return ([(f"built-in conversation {i}", r["messages"]) for i, r in enumerate(records)],
          f"{len(records)} built-in chat conversations (small, train) of {args.turns_min} to "
          f"{args.turns_max} user/assistant turns")


@errors.command("segpack bench chat-turns")
def main(argv: Sequence[str] | None = None) -> int:
  """Runs the benchmark; prints the table (or one JSON record per template with `--json`)."""
  args = _parser().parse_args(argv)
  directory = _directory(args.tokenizer)
  conversations, data = _conversations(args)
  results = [measure_template(directory, conversations, template_file=t)
             for t in (args.template or [None])]
  tables.print_results(results, as_json=args.json,
                       format_table=functools.partial(format_table, data=data))
  return 0


if __name__ == "__main__":
  sys.exit(main())

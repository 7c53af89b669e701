"""Preference pairs made here: chat pairs from the chat fixtures' conversations (each family's
real template rules respected), text pairs of standard-library sentences, and a toy task whose
chosen answers differ systematically from the rejected ones. Nothing is downloaded.

- `chat_pairs(family, n)`: records in TRL's explicit shape (`prompt` messages, `chosen` and
  `rejected` one assistant message each) and implicit shape (two whole conversations), with
  `tools` where the conversation has them. The rejected answer is another conversation's
  answer, so the two completions differ in content and length.
- `text_pairs(n)`: `{"prompt", "chosen", "rejected"}` strings of very different lengths.
- `toy_pairs(n)`: prompts "count: a b c", chosen the next letters, rejected a reversed run.
"""

from __future__ import annotations

import copy
import json
import os
import random
from typing import Any

from support import chat_fixtures
from support import hf_models


def _answer(message: dict[str, Any]) -> bool:
  return message.get("role") == "assistant" and not message.get("tool_calls")


def chat_pairs(family: str, n: int = 24, *, seed: int = 0) -> list[dict[str, Any]]:
  """`n` pairs from the family's fixture conversations, half explicit and half implicit."""
  records = chat_fixtures.conversations(family, max(2 * n, 40), seed=seed)
  answers = [m for r in records for m in r["messages"] if _answer(m)]
  rng = random.Random(seed)
  out = []
  for i, record in enumerate(records):
    messages = record["messages"]
    if not messages or not _answer(messages[-1]):
      continue
    chosen = messages[-1]
    rejected = copy.deepcopy(rng.choice([a for a in answers if a["content"] != chosen["content"]]))
    if i % 2:
      pair = dict(prompt=messages[:-1], chosen=[chosen], rejected=[rejected])
    else:
      pair = dict(chosen=messages, rejected=[*messages[:-1], rejected])
    if record.get("tools"):
      pair["tools"] = record["tools"]
    out.append(pair)
    if len(out) == n:
      break
  return out


def text_pairs(n: int = 40, *, seed: int = 0) -> list[dict[str, Any]]:
  """Text pairs: a prompt of 1-6 sentences, answers of 1-8 sentences (very uneven lengths)."""
  rng = random.Random(seed)
  pool = chat_fixtures.sentences()
  def text(k):
    return " ".join(rng.choice(pool) for _ in range(k))
  return [dict(prompt=text(rng.randint(1, 6)) + "\n", chosen=text(rng.randint(1, 8)),
               rejected=text(rng.randint(1, 8))) for _ in range(n)]


def toy_pairs(n: int, *, seed: int = 0) -> list[dict[str, str]]:
  """Prompts of 3 letters in order; chosen continues the alphabet, rejected goes backwards."""
  rng = random.Random(seed)
  letters = "abcdefghijklmnopqrstuvwxyz"
  out = []
  for _ in range(n):
    i = rng.randrange(3, 20)
    prompt = "count: " + " ".join(letters[i - 3:i]) + " ->"
    out.append(dict(prompt=prompt, chosen=" " + " ".join(letters[i:i + 4]),
                    rejected=" " + " ".join(reversed(letters[i - 4:i]))))
  return out


def write_jsonl(path: str | os.PathLike[str], records: list[dict[str, Any]]) -> str:
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return os.fspath(path)


def word_pairs(n: int, *, prompt: tuple[int, int], answer: tuple[int, int], seed: int = 0,
               vocab: tuple[str, ...] | None = None) -> list[dict[str, str]]:
  """Text pairs of the tiny word-level tokenizer's words (`support.hf_models.TOKENS`): a prompt
  of `prompt[0]..prompt[1]` words, answers of `answer[0]..answer[1]` words each."""
  words = vocab or tuple(hf_models.TOKENS)
  rng = random.Random(seed)

  def text(bounds):
    return " ".join(rng.choice(words) for _ in range(rng.randint(*bounds)))

  out = []
  while len(out) < n:
    pair = dict(prompt=text(prompt), chosen=" " + text(answer), rejected=" " + text(answer))
    if pair["chosen"] != pair["rejected"]:
      out.append(pair)
  return out

"""A pair to its two stored sequences: prompt + chosen and prompt + rejected, with loss masks.

Messages are rendered by a chat encoder that trains only the last assistant message
(`train_on="last_assistant"`): the tokenizer's own template (`segpack.text.chat.hf_chat`, with its
rules for turns, reasoning, tools and dates) or segpack's. Text pairs are the prompt's tokens
followed by the completion's, the completion trained (the pipeline's EOS after it too). Both
sequences must begin with the same prompt tokens, up to the first trained one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from segpack.text.chat import Conversation
from segpack.text.chat.preference.pairs import Pair, PairFormatError

__all__ = ["PairEncoder"]

Sequence = tuple[np.ndarray, np.ndarray]  # (token ids, uint8 loss mask)


class PairEncoder:
  """Encodes `Pair`s with a tokenizer (text pairs) and a chat encoder (message pairs).

  Example (text, one token per word): prompt "2 + 2 =", chosen "4", rejected "5" give
  `[2 + 2 = 4]` with mask `[0 0 0 0 1]` and `[2 + 2 = 5]` with mask `[0 0 0 0 1]`.
  """

  def __init__(self, tokenizer: Any, *, chat_encoder: Any = None):
    """Args:
      tokenizer: `encode(text) -> ids` (a segpack tokenizer).
      chat_encoder: for message pairs: `encode_conversation` training the last assistant
        message only (None: message pairs are refused).
    """
    self.tokenizer = tokenizer
    self.chat_encoder = chat_encoder
    if chat_encoder is not None and getattr(chat_encoder, "train_on", None) != "last_assistant":
      raise ValueError("PairEncoder: the chat encoder must train the last assistant message "
                       f"only (train_on='last_assistant'), got {chat_encoder.train_on!r}")

  def _text(self, pair: Pair, completion: str) -> Sequence:
    prompt = np.asarray(self.tokenizer.encode(pair.prompt), np.int64)
    answer = np.asarray(self.tokenizer.encode(completion), np.int64)
    if answer.size == 0:
      raise PairFormatError(f"{pair.where}: a completion encodes to no token: {completion!r:.60}")
    mask = np.concatenate([np.zeros(prompt.size, np.uint8), np.ones(answer.size, np.uint8)])
    return np.concatenate([prompt, answer]), mask

  def _messages(self, pair: Pair, which: str) -> Sequence:
    if self.chat_encoder is None:
      raise PairFormatError(f"{pair.where}: a pair of messages needs a chat template")
    conversation = Conversation(messages=pair.conversation(which), tools=pair.tools)
    encoded = self.chat_encoder.encode_conversation(
        conversation if pair.tools is not None else conversation.messages,
        where=f"{pair.where} ({which})")
    if len(encoded.samples) != 1:  # one trained turn: never expanded into several samples
      raise PairFormatError(f"{pair.where} ({which}): rendered as {len(encoded.samples)} "
                            f"samples, expected one")
    ids, mask = encoded.samples[0]
    return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)

  def encode(self, pair: Pair) -> tuple[Sequence, Sequence]:
    """`((chosen ids, mask), (rejected ids, mask))` of a pair.

    Raises:
      PairFormatError: naming the record: a completion with no token, prompts that render
        differently in the two sequences, or two equal sequences.
      ChatFormatError: the chat encoder's refusals (bad messages, template errors).
    """
    if pair.conversational:
      chosen, rejected = self._messages(pair, "chosen"), self._messages(pair, "rejected")
    else:
      chosen, rejected = self._text(pair, pair.chosen), self._text(pair, pair.rejected)
    firsts = [int(np.argmax(m)) if m.any() else -1 for _, m in (chosen, rejected)]
    if min(firsts) < 0:
      raise PairFormatError(f"{pair.where}: a completion has no trained token")
    if firsts[0] != firsts[1] or not np.array_equal(chosen[0][:firsts[0]],
                                                    rejected[0][:firsts[0]]):
      raise PairFormatError(
          f"{pair.where}: the prompt renders differently before chosen ({firsts[0]} tokens) "
          f"and before rejected ({firsts[1]} tokens); a pair's sequences must begin alike")
    if np.array_equal(chosen[0], rejected[0]):
      raise PairFormatError(f"{pair.where}: chosen and rejected encode to the same tokens")
    return chosen, rejected


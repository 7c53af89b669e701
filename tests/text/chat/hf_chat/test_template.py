"""Chat data rendered with a tokenizer's own chat template (segpack/text/chat/hf_chat/): masks of
conversations kept whole (`turns="whole"`), refusals, the tokenize CLI, datasets that carry their
template, packing without added BOS/EOS, the renderer API the sampler calls.

Every tokenizer is built here (a byte-level BPE trained on a few lines, the templates' special
tokens added, saved with transformers' `PreTrainedTokenizerFast`); the templates are written out
below (Llama 3.1, Qwen2.5, Mistral v0.3, Gemma, and a ChatML template with `{% generation %}`
markers). Oracles: transformers' own `return_assistant_tokens_mask` where the template has
generation markers; for every template, the decoded text of each trained run of tokens, compared
with the assistant payloads written out by hand here (content as the template writes it, then the
end-of-turn token, nothing of the next header).
"""

import json
import logging
import re
import shutil
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from configs import packed  # noqa: E402
from segpack import pack_dataset  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.files import sha256_file  # noqa: E402
from segpack.shards import ShardSource  # noqa: E402
from segpack.text import chat  # noqa: E402
from segpack.text import dataset  # noqa: E402
from segpack.text.chat import ChatFormatError  # noqa: E402
from segpack.text.chat import hf_chat  # noqa: E402
from segpack.text.tokenizers import spm  # noqa: E402
from train import data as data_lib  # noqa: E402
from train.export import tokenizer as hf_export_tokenizer  # noqa: E402
from train.runs import tokenizer as run_tokenizer  # noqa: E402
from support import data_configs  # noqa: E402

LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages | rejectattr("role", "equalto", "tool") | selectattr("tool_calls", "undefined") %}
    {%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ (message['content'] or '') + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Negative controls: rendering changes earlier text when a message is added.
COUNTING = ("{{ messages|length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "<|im_end|>\n{% endfor %}")
DROPS_THINKING = (  # as Qwen3 drops the reasoning of earlier assistant turns
    "{%- for m in messages %}{%- if m.role == 'assistant' and not loop.last %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\n') %}{%- else %}"
    "{%- set content = m.content %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

SPECIAL = ["<pad>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]",
           "[/INST]", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
# name: (template, bos, eos, end of an assistant turn, whether contents are trimmed)
TEMPLATES = {
    "llama31": (LLAMA31, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", True),
    "qwen25": (QWEN25, None, "<|im_end|>", "<|im_end|>", False),
    "mistral": (MISTRAL, "<s>", "</s>", "</s>", True),
    "gemma": (GEMMA, "<bos>", "<eos>", "<end_of_turn>", True),
    "generation": (GENERATION, None, "<|im_end|>", "<|im_end|>", False),
}
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TRAINING_LINES = ["Hello there, how are you today?", "The quick brown fox jumps over a dog.",
                  "Unicode: café naïve 日本語 ✓ 🙂", "def f(x):\n    return x + 1\n",
                  "system user assistant model ipython tool\n\n", '{"name": "get_weather"}',
                  "What is the weather in Paris? It is sunny."]


def U(text):
  return {"role": "user", "content": text}


def A(text):
  return {"role": "assistant", "content": text}


def S(text):
  return {"role": "system", "content": text}


CALL = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Paris"}}}]}
TOOL = {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1", "name": "get_weather"}
# 22 conversations; `REFUSED` lists those a template's own checks or its layout refuse.
CONVERSATIONS = {
    "single": [U("Hello there"), A("Hi, how are you?")],
    "system": [S("You are terse."), U("Hello"), A("Hi.")],
    "multi": [U("one"), A("first answer"), U("two"), A("second answer"), U("three"),
              A("third answer")],
    "system_multi": [S("Be kind."), U("one"), A("first"), U("two"), A("second")],
    "assistant_first": [A("I start."), U("ok"), A("Then I answer.")],
    "ends_with_user": [U("q1"), A("a1"), U("q2 left open")],
    "empty_answer": [U("say nothing"), A("")],
    "empty_question": [U(""), A("You said nothing.")],
    "unicode": [U("Café? 日本語"), A("Oui, café ✓ 🙂 naïve")],
    "padded": [U("pad"), A("  padded answer \n")],
    "code": [U("write f"), A("def f(x):\n    return x + 1")],
    "long": [U(f"q{i}") if i % 2 == 0 else A(f"answer number {i}") for i in range(10)],
    "tool": [U("Weather in Paris?"), CALL, TOOL, A("It is sunny, 21 C.")],
    "header_word": [U("Say the word"), A("assistant")],
    "same_words": [U("echo"), A("echo")],
    "numbers": [U("2+2?"), A("4, of course: 2 + 2 = 4.")],
    "system_empty_answer": [S("Terse."), U("Hi"), A("")],
    "two_assistants": [U("Hi"), A("Hello."), A("Anything else?")],
    "assistant_only": [A("Just me.")],
    "braces": [U("{{ not jinja }}"), A("{% raw %} {{ x }} as text")],
    "extra_keys": [U("hi", ) | {"name": "bob"}, A("hello bob")],
    "newlines": [U("a\n\nb"), A("\n\nline one\nline two\n")],
}
# The Mistral and Gemma templates check roles (raise_exception); Mistral writes the system
# prompt into the user turn only when that turn is the last message, so a render of a prefix
# ending there is not how the whole conversation begins.
# ChatML writes "\n" before the content: the answer's leading newlines merge with it, so the
# generation prompt's last token is not the conversation's there.
# Conversations kept whole: what cannot be is refused (tests/text/chat/hf_chat/test_turns.py
# expands).
WHOLE = hf_chat.ChatOptions(turns="whole")
MERGES = "not prefix-stable in tokens: the generation prompt of messages\\[1\\]"
REFUSED = {
    "qwen25": {"newlines": MERGES},
    "mistral": {"system": "not prefix-stable", "system_empty_answer": "not prefix-stable",
                "system_multi": "not prefix-stable", "assistant_first": "must alternate",
                "tool": "Only user and assistant", "two_assistants": "must alternate",
                "assistant_only": "must alternate"},
    "gemma": {"system": "System role", "system_multi": "System role",
              "assistant_first": "must alternate", "tool": "must alternate",
              "system_empty_answer": "System role", "two_assistants": "must alternate",
              "assistant_only": "must alternate"},
}
# The tool-calling turn as each template writes it (after its generation prompt).
TOOL_CALL_TEXT = {
    "llama31": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "qwen25": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "generation": "",
}


@pytest.fixture(scope="module")
def base_tokenizer():
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), behavior="isolated"),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=600, special_tokens=SPECIAL, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TRAINING_LINES * 10, trainer)
  return tok


def save_tokenizer(directory, base, template, *, bos=None, eos="<|im_end|>"):
  """A tokenizer directory: tokenizer.json, tokenizer_config.json and chat_template.jinja."""
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tokenizers.Tokenizer.from_str(base.to_str()), bos_token=bos,
      eos_token=eos, pad_token="<pad>", clean_up_tokenization_spaces=False)
  fast.chat_template = template
  fast.save_pretrained(str(directory))
  return directory


@pytest.fixture(scope="module")
def templates(base_tokenizer, tmp_path_factory):
  """name -> HfChatTemplate of each template (train_on="assistant")."""
  root = tmp_path_factory.mktemp("templates")
  out = {}
  for name, (template, bos, eos, _, _) in TEMPLATES.items():
    save_tokenizer(root / name, base_tokenizer, template, bos=bos, eos=eos)
    out[name] = hf_chat.HfChatTemplate(root / name, options=WHOLE)
  return out


def runs(mask):
  """The `(start, stop)` token index ranges of consecutive 1s."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
  return list(zip(edges[::2], edges[1::2]))


def payload(name, message):
  """What the template writes for an assistant message, through its end-of-turn token."""
  _, _, _, end, trims = TEMPLATES[name]
  if message.get("tool_calls"):
    return TOOL_CALL_TEXT[name] + end
  content = message["content"]
  return (content.strip() if trims else content) + end


def check_runs(name, renderer, messages, ids, mask, trained):
  """The decoded trained runs are the payloads of the `trained` messages, one each, in order:
  nothing before them but whitespace the first content token carries, nothing after."""
  hf = transformers.AutoTokenizer.from_pretrained(str(renderer.directory), local_files_only=True)
  got = [hf.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in runs(mask)]
  want = [payload(name, messages[k]) for k in trained]
  assert len(got) == len(want), (got, want)
  for text, expected in zip(got, want):
    assert text.endswith(expected) and not text[:len(text) - len(expected)].strip(), (
        text, expected)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_template_trains_exactly_the_assistant_payloads(templates, name):
  renderer = templates[name]
  refused = REFUSED.get(name, {})
  done = 0
  for key, messages in CONVERSATIONS.items():
    where = f"chats.jsonl:{key}"
    if key in refused:
      with pytest.raises(ChatFormatError, match=re.escape(where) + ".*" + refused[key]):
        renderer.encode(messages, where=where)
      continue
    ids, mask = renderer.encode(messages, where=where)
    want = renderer._hf.apply_chat_template(messages, tokenize=True, return_dict=True)
    assert ids.dtype == np.int64 and mask.dtype == np.uint8 and ids.size == mask.size
    assert ids.tolist() == list(want["input_ids"])  # the template's own tokens, BOS included
    trained = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    check_runs(name, renderer, messages, ids, mask, trained)
    done += 1
  assert done >= 15


def test_generation_markers_give_transformers_mask_token_for_token(templates):
  renderer = templates["generation"]
  assert renderer.generation_markers and not templates["qwen25"].generation_markers
  for key, messages in CONVERSATIONS.items():
    ids, mask = renderer.encode(messages, where=key)
    want = renderer._hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    assert mask.tolist() == list(want["assistant_masks"]), key
    assert ids.tolist() == list(want["input_ids"]), key


def test_the_prefix_method_equals_transformers_on_the_same_template_without_markers(
    templates, base_tokenizer, tmp_path):
  """The generation template with its markers removed renders the same text: the prefix method
  must find the spans transformers found with the markers."""
  plain = re.sub(r"\{% (end)?generation %\}", "", GENERATION)
  renderer = hf_chat.HfChatTemplate(save_tokenizer(tmp_path / "plain", base_tokenizer, plain))
  assert not renderer.generation_markers
  for key, messages in CONVERSATIONS.items():
    want = templates["generation"].encode(messages, where=key)
    if key == "newlines":  # markers define the mask; the prefix method checks the prompt
      with pytest.raises(ChatFormatError, match=MERGES):
        renderer.encode(messages, where=key)
      continue
    got = renderer.encode(messages, where=key)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist(), key


@pytest.mark.parametrize("name", ["llama31", "qwen25", "generation"])
def test_train_on_last_assistant_and_all(templates, name):
  directory = templates[name].directory
  last = hf_chat.HfChatTemplate(directory, train_on="last_assistant", options=WHOLE)
  every = hf_chat.HfChatTemplate(directory, train_on="all")
  for key in ("multi", "two_assistants", "tool", "long"):
    messages = CONVERSATIONS[key]
    ids, mask = last.encode(messages, where=key)
    final = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
    check_runs(name, last, messages, ids, mask, [final])
    ids_all, mask_all, counts = every.encode_counted(messages, where=key)
    assert ids_all.tolist() == ids.tolist() and mask_all.all()
    assert sum(counts.values()) == ids.size
    assert set(counts) >= {m["role"] for m in messages}
  # A conversation without an assistant message trains every token with "all" only.
  assert every.encode([U("hello")], where="x")[1].all()
  with pytest.raises(ChatFormatError, match="x:3: no assistant message"):
    last.encode([U("hello")], where="x:3")


def test_trained_tokens_are_counted_by_role(templates):
  ids, mask, counts = templates["llama31"].encode_counted(CONVERSATIONS["tool"], where="x")
  assert counts["assistant"] == int(mask.sum()) and counts["user"] == counts["tool"] == 0
  every = hf_chat.HfChatTemplate(templates["llama31"].directory, train_on="all")
  _, _, counts = every.encode_counted(CONVERSATIONS["system"], where="x")
  # The BOS is the template's own text before the first message.
  assert counts["template"] == 1 and counts["system"] > 0 and counts["assistant"] > 0


@pytest.mark.parametrize("template, match", [
    (COUNTING, r"messages\[1\] answered alone"), (DROPS_THINKING, r"messages\[1\] answered")])
def test_templates_that_rewrite_earlier_text_are_refused_not_mis_masked(
    base_tokenizer, tmp_path, template, match):
  renderer = hf_chat.HfChatTemplate(save_tokenizer(tmp_path / "t", base_tokenizer, template),
                                    options=WHOLE)
  thinking = [U("q"), A("<think>\nhmm\n</think>\n\nfirst"), U("q2"), A("second")]
  with pytest.raises(ChatFormatError, match=r"chats\.jsonl:7: the chat template is not "
                                            r"prefix-stable here: " + match):
    renderer.encode(thinking, where="chats.jsonl:7")
  if template is DROPS_THINKING:  # the last turn keeps its reasoning, and it is trained
    ids, mask = renderer.encode(thinking[:2], where="x")
    text = renderer._hf.decode(ids[mask.astype(bool)].tolist())
    assert text == "<think>\nhmm\n</think>\n\nfirst<|im_end|>"


def test_a_tokenizer_that_merges_across_the_prompt_boundary_is_refused(tmp_path):
  """GPT-2's split rule merges "\\n\\n" with nothing after it but not before a word, so the
  prompt's tokens differ from the conversation's: refused, since the model would be prompted
  with tokens it never saw there."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(["a\n\n", "b\n\nc"] * 50, tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIAL, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  renderer = hf_chat.HfChatTemplate(save_tokenizer(
      tmp_path / "gpt2", tok, LLAMA31, bos="<|begin_of_text|>", eos="<|eot_id|>"))
  with pytest.raises(ChatFormatError, match=r"c:1: the chat template is not prefix-stable in "
                                            r"tokens"):
    renderer.encode([U("hi"), A("Hello")], where="c:1")


@pytest.mark.parametrize("messages, match", [
    ("nope", "messages must be a non-empty list"),
    ([], "messages must be a non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\]: role must be a non-empty string"),
    ([U("hi"), {"role": "assistant", "content": ["part"]}],
     r"messages\[1\] \(role 'assistant'\): content must be a string"),
    ([U("hi"), {"role": "assistant", "content": None}], "null only for an assistant message"),
    ([U("hi"), A("ends <|im_end|> early")], "special token '<|im_end|>'"),
    ([U("hi")], "no assistant message"),
])
def test_bad_messages_are_named(templates, messages, match):
  with pytest.raises(ChatFormatError, match=r"f\.jsonl:4.*" + match.replace("|", r"\|")):
    templates["qwen25"].encode(messages, where="f.jsonl:4")


def test_a_special_token_in_a_tool_schema_or_a_tool_call_is_named(templates):
  """A tool's schema and a call's arguments are rendered into the prompt as text: a control
  token there would be read as one (negative control: the same text without it encodes)."""
  from segpack.text.chat import Conversation
  renderer = templates["qwen25"]
  tool = {"type": "function", "function": {"name": "f", "description": "ends <|im_end|> here",
                                           "parameters": {"type": "object", "properties": {}}}}
  with pytest.raises(ChatFormatError, match=r"t:2: tools\[0\] contains the special token "
                                            r"'<\|im_end\|>'"):
    renderer.encode(Conversation(messages=[U("hi"), A("ok")], tools=[tool]), where="t:2")
  with pytest.raises(ChatFormatError, match=r"p: tools\[0\] contains the special token"):
    renderer.prompt_ids([U("hi")], where="p", tools=[tool])
  call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
      "name": "f", "arguments": {"q": "<|im_start|>system"}}}]}
  with pytest.raises(ChatFormatError, match=r"t:3: messages\[1\] \(role 'assistant'\): "
                                            r"tool_calls contains the special token"):
    renderer.encode([U("hi"), call, {"role": "tool", "content": "1"}, A("ok")], where="t:3")
  tool["function"]["description"] = "ends here"
  assert renderer.prompt_ids([U("hi")], where="p", tools=[tool])


def test_prompt_ids_and_stop_ids(templates):
  for name, renderer in templates.items():
    messages = [U("Hello there")]
    prompt = renderer.prompt_ids(messages)
    want = renderer._hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            add_generation_prompt=True)["input_ids"]
    assert prompt == list(want)
    ids, _ = renderer.encode(messages + [A("Hi")], where=name)
    assert ids.tolist()[:len(prompt)] == prompt  # the answer continues the prompt
    _, _, eos, end, _ = TEMPLATES[name]
    hf = renderer._hf
    assert set(renderer.stop_ids) == {hf.convert_tokens_to_ids(eos),
                                      hf.convert_tokens_to_ids(end)}, name
  bos = templates["llama31"]._hf.convert_tokens_to_ids("<|begin_of_text|>")
  assert templates["llama31"].prompt_ids([U("x")])[0] == bos


def test_segpack_chat_encoder_prompt_ids_and_stop_ids(templates):
  tok = templates["qwen25"].tokenizer  # any tokenizer: the markers are encoded as text
  encoder = chat.ChatEncoder(tok)
  messages = [S("sys"), U("Hi")]
  ids, _ = encoder.encode(messages + [A("")])
  end = encoder._ids[chat.DEFAULT_TEMPLATE.end_of_turn]
  assert encoder.prompt_ids(messages) == ids[:ids.size - end.size].tolist()
  assert encoder.stop_ids == (tok.eos_id,)  # "<|end|>" is several tokens of this tokenizer


def _chat_jsonl(path, conversations, extra_lines=()):
  lines = [json.dumps({"messages": m}) for m in conversations] + list(extra_lines)
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return path


def test_tokenize_cli_records_the_template_and_the_dataset_stands_alone(
    base_tokenizer, tmp_path, capsys):
  source = save_tokenizer(tmp_path / "model", base_tokenizer, QWEN25)
  conversations = [m for k, m in CONVERSATIONS.items() if k not in REFUSED["qwen25"]]
  jsonl = _chat_jsonl(tmp_path / "chats.jsonl", conversations)
  out = tmp_path / "data"
  rc = tokenize_cli.main(["--input", str(jsonl), "--output", str(out), "--tokenizer",
                          f"hf:{source}", "--format", "chat", "--no-progress"])
  printed = capsys.readouterr().out
  assert rc == 0
  src = ShardSource(out)
  src.verify()
  described = src.manifest["metadata"]["chat"]
  assert described["renderer"] == "hf" and described["add_bos_eos"] is False
  assert described["template_file"] == "chat_template.jinja"
  assert described["template_sha256"] == "sha256:" + sha256_file(source / "chat_template.jinja")
  renderer = hf_chat.HfChatTemplate(source)
  masks = [renderer.encode(m, where="x") for m in conversations]
  assert [np.asarray(src[i]).tolist() for i in range(len(src))] == [
      ids.tolist() for ids, _ in masks]
  assert [np.asarray(src.loss_mask(i)).tolist() for i in range(len(src))] == [
      mask.tolist() for _, mask in masks]
  by_role = described["trained_tokens_by_role"]
  assert by_role["assistant"] == sum(int(mask.sum()) for _, mask in masks)
  assert by_role["user"] == by_role["system"] == by_role["tool"] == 0
  assert described["skipped_conversations"] == 0
  assert f"assistant {by_role['assistant']:,}" in printed and "trained tokens by role" in printed
  # The source directory gone, the dataset alone gives the renderer.
  shutil.rmtree(source)
  loaded = hf_chat.for_dataset(out)
  assert isinstance(loaded, hf_chat.HfChatTemplate) and loaded.train_on == "assistant"
  ids, mask = loaded.encode(conversations[3], where="x")
  assert ids.tolist() == np.asarray(src[3]).tolist() and mask.tolist() == masks[3][1].tolist()
  assert loaded.stop_ids == (loaded._hf.convert_tokens_to_ids("<|im_end|>"),)
  # A damaged copy is refused by name; so is a missing one.
  (out / "chat_template.jinja").write_text(QWEN25 + " ", encoding="utf-8")
  with pytest.raises(hf_chat.DatasetRendererError, match=r"chat_template\.jinja: damaged"):
    hf_chat.for_dataset(out)
  (out / "chat_template.jinja").unlink()
  with pytest.raises(hf_chat.DatasetRendererError, match=r"chat_template\.jinja: missing"):
    hf_chat.for_dataset(out)


def test_packed_rows_hold_exactly_the_templates_tokens(base_tokenizer, tmp_path, caplog):
  source = save_tokenizer(tmp_path / "model", base_tokenizer, LLAMA31, bos="<|begin_of_text|>",
                          eos="<|eot_id|>")
  conversations = [m for k, m in CONVERSATIONS.items() if k not in ("padded",)]
  out = tmp_path / "data"
  dataset.tokenize_files([_chat_jsonl(tmp_path / "c.jsonl", conversations)], out,
                         tokenizer=f"hf:{source}", input_format="chat")
  renderer = hf_chat.HfChatTemplate(source)
  docs = {tuple(renderer.encode(m, where="x")[0].tolist()) for m in conversations}
  rows = pack_dataset(str(out), seq_len=512, shuffle=False, num_epochs=1)  # default SpecialTokens
  seen = 0
  for r in range(len(rows)):
    row = rows[r]
    for s in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
      tokens = tuple(row["input_ids"][row["segment_ids"] == s].tolist())
      assert tokens in docs  # no BOS or EOS added around the template's own
      seen += 1
  assert seen == len(conversations)
  # The trainer's data path too, with one log line saying so.
  spec = data_configs.data_config(
      source="builtin", size="small", cache_dir=None, seq_len=512, strategy="ffd",
      long_docs="split", max_segments_per_row=None, add_bos=True, add_eos=True, seed=0,
      synthetic_docs=0, synthetic_mean_len=0, synthetic_vocab=0, train=str(out), eval_share=0)
  with caplog.at_level(logging.INFO, logger="train.data"):
    data = data_lib.make_data(spec, batch_size=4, process_index=0, process_count=1)
  assert sum("packing adds no BOS/EOS" in r.getMessage() for r in caplog.records) == 1
  batch = data.train[0]
  for r in range(len(batch["input_ids"])):
    for s in np.unique(batch["segment_ids"][r][batch["segment_ids"][r] > 0]):
      assert tuple(batch["input_ids"][r][batch["segment_ids"][r] == s].tolist()) in docs


def test_skip_bad_lines_counts_refused_conversations(base_tokenizer, tmp_path, capsys):
  source = save_tokenizer(tmp_path / "model", base_tokenizer, DROPS_THINKING)
  good = [CONVERSATIONS["single"], CONVERSATIONS["multi"], CONVERSATIONS["unicode"]]
  bad = [U("q"), A("<think>\nhmm\n</think>\n\nfirst"), U("q2"), A("second")]
  jsonl = _chat_jsonl(tmp_path / "chats.jsonl", good[:2] + [bad] + good[2:], ["{not json"])
  args = ["--input", str(jsonl), "--tokenizer", f"hf:{source}", "--format", "chat",
          "--no-progress", "--turns", "whole"]
  rc = tokenize_cli.main(args + ["--output", str(tmp_path / "strict")])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1
  assert f"{jsonl}:3: the chat template is not prefix-stable" in err
  rc = tokenize_cli.main(args + ["--output", str(tmp_path / "out"), "--skip-bad-lines"])
  printed = capsys.readouterr().out
  assert rc == 0 and re.search(r"skipped bad lines\s+2\n", printed)
  src = ShardSource(tmp_path / "out")
  assert len(src) == 3 and src.manifest["metadata"]["chat"]["skipped_conversations"] == 2


def test_skip_bad_lines_also_works_for_segpacks_template(tmp_path):
  model = spm.train_spm(TRAINING_LINES * 20, tmp_path / "m.model", vocab_size=320,
                        user_defined_symbols=list(chat.DEFAULT_TEMPLATE.markers))
  jsonl = _chat_jsonl(tmp_path / "c.jsonl", [[U("hello"), A("world")],
                                             [{"role": "tool", "content": "x"}, A("world")]],
                      ["[1, 2]"])
  with pytest.raises(ChatFormatError, match=r"c\.jsonl:2: messages\[0\]: role"):
    dataset.tokenize_files([jsonl], tmp_path / "a", spm_model=model.model_file,
                           input_format="chat")
  summary, = dataset.tokenize_files([jsonl], tmp_path / "b", spm_model=model.model_file,
                                    input_format="chat", skip_bad_lines=True)
  encoder = hf_chat.for_dataset(tmp_path / "b")
  assert isinstance(encoder, chat.ChatEncoder)
  ids, mask = encoder.encode([U("hello"), A("world")])
  assert ids.tolist() == np.asarray(ShardSource(tmp_path / "b")[0]).tolist()
  assert summary.documents == 1 and summary.bad_lines == 2
  assert summary.trained_by_role == {"user": 0, "assistant": int(mask.sum())}


def test_without_transformers_the_cli_names_the_extra(base_tokenizer, tmp_path, capsys,
                                                      monkeypatch):
  source = save_tokenizer(tmp_path / "model", base_tokenizer, QWEN25)
  jsonl = _chat_jsonl(tmp_path / "c.jsonl", [CONVERSATIONS["single"]])
  monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
  rc = tokenize_cli.main(["--input", str(jsonl), "--output", str(tmp_path / "out"),
                          "--tokenizer", f"hf:{source}", "--format", "chat", "--no-progress"])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1 and "pip install 'segpack[hf]'" in err


def test_export_keeps_the_tokenizers_own_template(base_tokenizer, tmp_path):
  source = save_tokenizer(tmp_path / "model", base_tokenizer, GEMMA, bos="<bos>", eos="<eos>")
  out = tmp_path / "data"
  dataset.tokenize_files([_chat_jsonl(tmp_path / "c.jsonl", [CONVERSATIONS["single"]])], out,
                         tokenizer=f"hf:{source}", input_format="chat")
  config = packed.get_config("smoke")
  config.data.train = str(out)
  renderer = run_tokenizer.chat_renderer(config, str(tmp_path), stage=False)
  assert isinstance(renderer, hf_chat.HfChatTemplate)
  template = hf_export_tokenizer.exported_template(renderer)
  assert template is None  # nothing of segpack's to write over the model's own
  (tmp_path / "exported").mkdir()
  names, _ = hf_export_tokenizer.write_tokenizer(tmp_path / "exported", config, source=None,
                                                 template=template)
  assert "chat_template.jinja" in names
  assert (tmp_path / "exported" / "chat_template.jinja").read_text() == GEMMA


@pytest.mark.parametrize("answer", ["im", "end", "a", "|", "Hi", "\n"])
def test_an_assistant_first_turn_trains_its_answer_as_generation_marks_it(
    templates, base_tokenizer, tmp_path, answer):
  """A conversation that opens with the assistant (no generation prompt before it) and a short
  answer, which also occurs inside the template's own text (`im` in `<|im_end|>`): the prefix
  method (the generation template without its markers) trains what transformers'
  `{% generation %}` mask trains, the answer and its end of turn."""
  messages = [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"},
              {"role": "assistant", "content": "Because."}]
  want = templates["generation"]._hf.apply_chat_template(
      messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
  plain = re.sub(r"\{% (end)?generation %\}", "", GENERATION)
  renderer = hf_chat.HfChatTemplate(save_tokenizer(tmp_path / "plain", base_tokenizer, plain))
  ids, mask = renderer.encode(messages, where="assistant-first")
  assert ids.tolist() == list(want["input_ids"])
  assert mask.tolist() == list(want["assistant_masks"])

"""`train.sample --chat --tools FILE --conversation FILE` on a model fine-tuned in its own (Qwen3's)
chat template.

A tiny Qwen3 made with transformers carries `chat_fixtures.make_tokenizer(DIR, "qwen3")` (Qwen3's
real template), is fine-tuned for a few steps on conversations with tools and tool calls
tokenized by `segpack tokenize --tokenizer hf:DIR`, then exported. Oracle: transformers'
greedy `generate` on the export, prompted with `apply_chat_template(messages, tools=tools,
add_generation_prompt=True)` of the same conversation; the sampler's greedy tokens must be the
same. Negative controls: the prompt without the tools, or with the conversation's own tools
(which `--tools` replaces), has other tokens and another answer.
"""

import json
import os
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from configs import packed  # noqa: E402
from support import chat_datasets  # noqa: E402
from support import chat_fixtures  # noqa: E402
from support import hf_models  # noqa: E402
from support import paths  # noqa: E402
from support import train_configs  # noqa: E402
from train.hf import config as hf_config  # noqa: E402
from train.export import command as export_lib  # noqa: E402
from train.runs import saved as saved_run  # noqa: E402
from train.runs import tokenizer as run_tokenizer  # noqa: E402
from train.sample import prompts as sample_prompts  # noqa: E402
from train.sample import command as sample_lib  # noqa: E402

NEW = 12


def _write(path, value):
  path.write_text(json.dumps(value), "utf-8")
  return path


def _train(model_dir, data, workdir, *, steps, add_bos=True):
  config = packed.get_config()
  config.model.init_from = str(model_dir)
  config.data.train = str(data)
  config.data.add_bos = add_bos
  config.packing.seq_len = 1024
  hf_config.adopt(config)
  train_configs.short_run(config, workdir, steps=steps)
  return str(workdir)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  """A tiny Qwen3 with Qwen3's template, fine-tuned 3 steps on chats with tools, and exported;
  the conversation asked (ending with a tool result) and the tools given with `--tools`."""
  root = tmp_path_factory.mktemp("qwen3_tools")
  model_dir = chat_fixtures.make_tokenizer(root / "model", "qwen3")
  tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
  hf_models.make_model(str(model_dir), "qwen3", vocab_size=len(tok), hidden_size=32,
                       head_dim=8, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, bos_token_id=None, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
  records = chat_fixtures.conversations("qwen3", 16)
  chats = root / "chats.jsonl"
  chats.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
  data = chat_datasets.tokenize(chats, root / "data", "--tokenizer", f"hf:{model_dir}")
  workdir = _train(model_dir, data, root / "run", steps=3)
  assert export_lib.main(["--workdir", workdir, "--output", str(root / "exported")]) == 0
  asked = next(r for r in records if r.get("tools") and r["messages"][-2]["role"] == "tool")
  messages = asked["messages"][:-1]  # the model answers the last assistant turn itself
  given = [t for t in chat_fixtures.tool_schemas() if t not in asked["tools"]][:2]
  return dict(root=root, model=model_dir, workdir=workdir, export=str(root / "exported"),
              messages=messages, own_tools=asked["tools"], tools=given,
              conversation=_write(root / "conversation.json",
                                  {"messages": messages, "tools": asked["tools"]}),
              tools_file=_write(root / "tools.json", {"tools": given}))


def _ids(encoded):
  return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _generate(export, messages, tools):
  """transformers' greedy answer on the export: `(prompt ids, new ids through the first EOS)`."""
  tok = transformers.AutoTokenizer.from_pretrained(export)
  model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
  prompt = _ids(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True))
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW,
                         min_new_tokens=0, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, top_k=None, top_p=None,
                         temperature=None)
  new = out[0, len(prompt):].tolist()
  return prompt, new[:new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "train.sample", *args], cwd=paths.REPO,
                        env=dict(os.environ, PYTHONPATH=str(paths.REPO),
                                 XLA_FLAGS=train_configs.one_cpu_device()), capture_output=True,
                        text=True, timeout=300)


def test_conversation_with_tools_answers_as_transformers_generate_on_the_export(qwen3):
  prompt, want = _generate(qwen3["export"], qwen3["messages"], qwen3["tools"])
  config, _ = saved_run.run_config(qwen3["workdir"])
  renderer = run_tokenizer.chat_renderer(config, qwen3["workdir"])
  assert renderer.prompt_ids(qwen3["messages"], tools=qwen3["tools"]) == prompt
  # Negative controls: without tools, or with the conversation's own, the prompt and the answer
  # differ, so a sampler dropping `--tools` (or preferring the file's own) fails below.
  for tools in (None, qwen3["own_tools"]):
    other_prompt, other = _generate(qwen3["export"], qwen3["messages"], tools)
    assert renderer.prompt_ids(qwen3["messages"], tools=tools) == other_prompt != prompt
    assert other != want
  (answer,) = sample_lib.sample(
      qwen3["workdir"], chat_mode=True, max_new_tokens=NEW,
      conversation=sample_prompts.read_conversation(str(qwen3["conversation"])),
      tools=sample_prompts.read_tools(str(qwen3["tools_file"])))
  assert list(answer.new_ids) == want
  proc = _cli(f"--workdir={qwen3['workdir']}", "--chat", f"--conversation={qwen3['conversation']}",
              f"--tools={qwen3['tools_file']}", f"--max_new_tokens={NEW}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  header, *text = proc.stdout.splitlines()
  assert header == "=== prompt 1, sample 1/1 (greedy) from step 3 ==="
  shown = want[:-1] if want and want[-1] == renderer.stop_ids[0] else want
  assert text == run_tokenizer.tokenizer_for_run(config).decode(shown).splitlines()


def test_tools_apply_to_each_prompt(qwen3):
  question = "Which function reads a section of the docs?"
  messages = [{"role": "user", "content": question}]
  prompt, want = _generate(qwen3["export"], messages, qwen3["tools"])
  assert prompt != _generate(qwen3["export"], messages, None)[0]
  (answer,) = sample_lib.sample(qwen3["workdir"], chat_mode=True, prompts=[question],
                                tools=qwen3["tools"], max_new_tokens=NEW)
  assert list(answer.new_ids) == want


@pytest.mark.parametrize("content, message", [
    ('["lookup_doc"]', "tools must be a list of objects (JSON schemas), got ['lookup_doc']"),
    ("{not json", "not JSON: Expecting property name enclosed in double quotes"),
    ('{"functions": []}', "an object without a 'tools' list"),
])
def test_a_bad_tools_file_is_refused_in_one_line(qwen3, tmp_path, content, message):
  bad = tmp_path / "tools.json"
  bad.write_text(content, "utf-8")
  with pytest.raises(sample_prompts.SampleError) as raised:
    sample_prompts.read_tools(str(bad))
  assert str(raised.value).startswith(f"--tools {bad}: {message}")
  if content.startswith("["):  # the command says the same, exit status 2
    proc = _cli(f"--workdir={qwen3['workdir']}", "--chat", f"--tools={bad}", "--prompt=Hi")
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr.splitlines() == [f"python -m train.sample: error: {raised.value}"]


def test_a_bad_conversation_file_is_refused_naming_the_flag_and_the_file(qwen3, tmp_path):
  path = tmp_path / "conversation.json"
  missing = tmp_path / "missing.json"
  with pytest.raises(sample_prompts.SampleError, match=f"^--conversation {missing}: cannot read it: "
                     "No such file or directory$"):
    sample_prompts.read_conversation(str(missing))
  cases = {'{"messages": "Hi"}': "messages must be a non-empty list, got 'Hi'",
           '{"turns": []}': "an object without a 'messages' list",
           '[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]':
               "the last message has role 'assistant'; end with a user or tool message",
           '{"messages": [{"role": "user", "content": "Hi"}], "tools": {"name": "x"}}':
               "tools must be a list of objects"}
  for content, message in cases.items():
    path.write_text(content, "utf-8")
    with pytest.raises(sample_prompts.SampleError) as raised:
      sample_prompts.read_conversation(str(path))
    assert str(raised.value).startswith(f"--conversation {path}: {message}"), content
  path.write_text(json.dumps(qwen3["messages"]), "utf-8")  # a bare list of messages is read
  assert sample_prompts.read_conversation(str(path)).messages == qwen3["messages"]


def test_tools_and_conversation_need_chat_and_no_other_prompt(qwen3):
  conversation = sample_prompts.read_conversation(str(qwen3["conversation"]))
  refused = {"--tools needs --chat": dict(prompts=["Hi"], tools=qwen3["tools"]),
             "--conversation needs --chat": dict(conversation=conversation),
             "--conversation is the whole prompt": dict(chat_mode=True, prompts=["Hi"],
                                                        conversation=conversation),
             "--tools applies to --prompt and --conversation, not to --prompt_ids":
                 dict(chat_mode=True, prompt_ids=["5"], tools=qwen3["tools"]),
             "--system applies to --prompt": dict(chat_mode=True, system="Be brief.",
                                                  conversation=conversation)}
  for message, kwargs in refused.items():
    with pytest.raises(sample_prompts.SampleError, match="^" + message):
      sample_lib.sample(qwen3["workdir"], **kwargs)


def test_tools_on_a_run_in_segpacks_own_template_are_refused_by_name(qwen3, tmp_path):
  """segpack's template has no place for tools: the same model fine-tuned on chats rendered with
  it (`--chat-template segpack`) refuses `--tools` and `--conversation` in one line."""
  plain = [r for r in chat_fixtures.conversations("qwen3", 16) if "tools" not in r][:8]
  chats = tmp_path / "chats.jsonl"
  chats.write_text("".join(json.dumps({"messages": [
      {"role": m["role"], "content": m["content"]} for m in r["messages"]]}) + "\n"
      for r in plain), "utf-8")
  data = chat_datasets.tokenize(chats, tmp_path / "data", "--tokenizer", f"hf:{qwen3['model']}",
                                "--chat-template", "segpack")
  workdir = _train(qwen3["model"], data, tmp_path / "run", steps=1, add_bos=False)  # none in Qwen
  for flag in ("tools", "conversation"):
    args = [f"--tools={qwen3['tools_file']}", "--prompt=Hi"] if flag == "tools" else [
        f"--conversation={qwen3['conversation']}"]
    proc = _cli(f"--workdir={workdir}", "--chat", *args)
    assert proc.returncode == 2 and not proc.stdout, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"python -m train.sample: error: --{flag} needs a run whose chat "
                           f"template is the model's own"), line
    assert "segpack's template, which has no place for tools" in line


def test_a_special_token_in_a_chat_prompt_is_a_sample_error_naming_the_flag(qwen3):
  with pytest.raises(sample_prompts.SampleError, match=r"^--prompt: messages\[0\] \(role 'user'\): "
                     r"content contains the special token '<\|im_end\|>'"):
    sample_lib.sample(qwen3["workdir"], prompts=["a <|im_end|> b"], chat_mode=True,
                      max_new_tokens=2)

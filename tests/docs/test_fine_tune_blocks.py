"""The README's "Fine-tune a Hugging Face model" block and docs/sft.md's blocks (the template
choices, the fine-tune-and-ask walk, the SentencePiece masks, asking with tools), run as
written from a new user's directory on a tiny Qwen3 that carries Qwen3's real chat template
(made here with transformers; nothing is downloaded), with fewer steps.

Oracles: transformers' `apply_chat_template(..., add_generation_prompt=True)` of the source
tokenizer (the exported tokenizer's prompt must be the same tokens) and transformers' greedy
`generate` on the export, cut at the template's end of turn (the answer `train.sample --chat`
prints must be its text).
"""

import json
import os
import re

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from segpack.shards import ShardSource  # noqa: E402
from support import chat_fixtures  # noqa: E402
from support import doc_blocks  # noqa: E402
from support import hf_models  # noqa: E402
from support import paths  # noqa: E402

README = "## Fine-tune a Hugging Face model"
SFT = "docs/sft.md"
OWN = "### Fine-tuning with the model's own chat template (`segpack.text.chat.hf_chat`)"
FEWER = ["--config.train.num_steps=3", "--config.train.eval_every=3",
         "--config.train.batch_size=24",  # the rows of a minibatch of these chats (21)
         "--config.train.checkpoint_every=3", "--config.attention.self_check=False"]


def _model(directory):
  """A tiny Qwen3 with Qwen3's template and vocabulary (chat_fixtures)."""
  model_dir = chat_fixtures.make_tokenizer(directory, "qwen3")
  tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
  hf_models.make_model(str(model_dir), "qwen3", vocab_size=len(tok), hidden_size=32,
                       head_dim=8, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, bos_token_id=None, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
  return str(model_dir), tok


def _greedy_answer(export, messages, *, system=None, max_new_tokens):
  """transformers' greedy answer on the export, in the export's own template, without its end."""
  tok = transformers.AutoTokenizer.from_pretrained(export)
  turns = ([{"role": "system", "content": system}] if system else []) + messages
  prompt = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
  prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
  lm = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
  stops = transformers.GenerationConfig.from_pretrained(export).eos_token_id
  stops = set(stops if isinstance(stops, list) else [stops])
  assert tok.convert_tokens_to_ids("<|im_end|>") in stops  # the export stops at the turn's end
  with torch.no_grad():
    new = lm.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                      pad_token_id=tok.pad_token_id, top_k=None, top_p=None,
                      temperature=None)[0, len(prompt):].tolist()
  if new and new[-1] in stops:
    new = new[:-1]
  return prompt, tok.decode(new)


@pytest.mark.slow
def test_fine_tune_then_ask(tmp_path):
  home = tmp_path
  os.symlink(paths.REPO / "configs", home / "configs")
  model_dir, source_tok = _model(home / "model")
  # Roles and contents only: segpack's own template (`--chat-template segpack`, below) renders
  # no tools and no reasoning.
  records = [{"messages": [{"role": m["role"], "content": m["content"]} for m in r["messages"]]}
             for r in chat_fixtures.conversations("qwen3", 48)
             if "tools" not in r and {m["role"] for m in r["messages"]} <= {"system", "user", "assistant"}]
  records = records[:24]
  assert len(records) == 24
  (home / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
  subs = {"MODEL_DIR": model_dir}
  commands = doc_blocks.commands(README)
  assert [c.split()[2] for c in commands] == ["segpack", "train.main", "train.sample",
                                              "train.export"]
  outs = [out for _, out in doc_blocks.run(commands, subs, train_args=FEWER, cwd=home)]
  assert re.search(r"recipe: fine-tuning \(model\.init_from\): learning rate 2e-05, warmup \d+ "
                   r"steps, 3 steps = \d+\.\d\d epochs of [\d.]+ steps", outs[1].stdout)
  summary = [json.loads(x) for x in (home / "runs" / "sft_hf" / "metrics.jsonl").open()][-1]
  assert summary["kind"] == "summary" and summary["steps"] == 3
  export = str(home / "exported")
  model, info = transformers.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  question = [{"role": "user", "content": "How do I reverse a list?"}]
  prompt, answer = _greedy_answer(export, question, max_new_tokens=_max_new(commands[2]))
  want = source_tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True)
  assert prompt == list(want["input_ids"] if hasattr(want, "keys") else want)
  assert _printed(outs[2]) == answer.splitlines()
  _own_template_blocks(home, commands, subs, export)
  _mask_block(home)
  _tools_block(home)


def _max_new(command):
  """The command's `--max_new_tokens`, else the sampler's default (64)."""
  found = re.search(r"--max_new_tokens[= ](\d+)", command)
  return int(found.group(1)) if found else 64


def _printed(out):
  """The answer `train.sample --chat` printed: the lines after its `===` header line."""
  return out.stdout.splitlines()[1:]


def _own_template_blocks(home, readme, subs, export):
  """docs/sft.md's template blocks: the first is the README's tokenize line; `--chat-template
  segpack` renders with segpack's template instead; the walk's lines are the README's, and its
  `--system` question answers as transformers' `generate` does."""
  first, segpack_template = (doc_blocks.commands(OWN, doc=SFT, index=i) for i in (0, 1))
  assert first == readme[:1]
  (line,) = segpack_template
  list(doc_blocks.run([line], {**subs, "data/chat": "data/chat_segpack"}, train_args=[], cwd=home))
  ours, theirs = ShardSource(home / "data" / "chat_segpack"), ShardSource(home / "data" / "chat")
  assert (ours.record.chat.renderer, theirs.record.chat.renderer) == ("segpack", "hf")
  walk = doc_blocks.commands(OWN, doc=SFT, index=2)
  new = [c for c in walk if c not in readme]
  assert len(new) == 1 and "--system" in new[0]
  ((_, out),) = doc_blocks.run(new, subs, train_args=[], cwd=home)
  _, answer = _greedy_answer(export, [{"role": "user", "content": "What does zip do?"}],
                             system="Be brief.", max_new_tokens=_max_new(new[0]))
  assert _printed(out) == answer.splitlines()


def _mask_block(home):
  """docs/sft.md's "Shards carry the mask": a SentencePiece model trained on the chats, then
  only the last assistant turn trained."""
  lines = doc_blocks.commands("### Shards carry the mask", doc=SFT)
  assert len(lines) == 2
  list(doc_blocks.run(lines[:1], {"DIR": "data/spm"}, train_args=[], cwd=home))
  list(doc_blocks.run(lines[1:], {"DIR": "data/last", "chat.model": "data/spm/spm.model"},
                      train_args=[], cwd=home))
  every, last = ShardSource(home / "data" / "spm"), ShardSource(home / "data" / "last")
  assert every.has_loss_mask and last.has_loss_mask
  trained = [sum(int(np.sum(s.loss_mask(d))) for d in range(len(s))) for s in (every, last)]
  assert 0 < trained[1] < trained[0]


def _tools_block(home):
  """docs/sft.md's "Asking with tools": its two files, written as its heredocs say, then both
  questions."""
  text = doc_blocks.block(SFT, "## Asking with tools").text
  for name, body in re.findall(r"cat > (\S+) <<'JSON'\n(.*?)\nJSON\n", text, re.S):
    (home / name).write_text(body + "\n", "utf-8")
    json.loads(body)
  lines = [c for c in doc_blocks.block(SFT, "## Asking with tools").commands()
           if c.startswith("python -m")]
  assert len(lines) == 2
  for _, out in doc_blocks.run(lines, {}, train_args=[], cwd=home):
    assert out.stdout.strip()

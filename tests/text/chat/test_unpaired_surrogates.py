"""A chat or preference record holding an unpaired surrogate (a lone `\\ud800` escape, which no
tokenizer encodes) is one line naming file:line, or with --skip-bad-lines skipped and counted;
it never reaches the tokenizer (a `tokenizers` TypeError before)."""

import pytest

pytest.importorskip("transformers")

from segpack import shards  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from support import chat_fixtures  # noqa: E402

CHAT = ('{"messages": [{"role": "user", "content": "a\\ud800b"}, '
        '{"role": "assistant", "content": "x"}]}')
GOOD_CHAT = '{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "x"}]}'
PAIR = '{"prompt": "p\\udc00", "chosen": "a", "rejected": "b"}'
GOOD_PAIR = '{"prompt": "p", "chosen": "a", "rejected": "b"}'


@pytest.mark.parametrize("fmt, bad, good", [("chat", CHAT, GOOD_CHAT),
                                            ("preference", PAIR, GOOD_PAIR)])
def test_an_unpaired_surrogate_is_one_line_or_skipped(tmp_path, capsys, fmt, bad, good):
  tokenizer = chat_fixtures.make_tokenizer(tmp_path / "tok", "qwen2_5")
  path = tmp_path / "in.jsonl"
  path.write_text("\n".join([good, bad, good]) + "\n")
  argv = ["--format", fmt, "--input", str(path), "--tokenizer", f"hf:{tokenizer}"]
  assert tokenize_cli.main([*argv, "--output", str(tmp_path / "a")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"{path}:2: holds an unpaired surrogate" in err
  assert tokenize_cli.main([*argv, "--output", str(tmp_path / "b"), "--skip-bad-lines"]) == 0
  assert len(shards.ShardSource(tmp_path / "b")) == (2 if fmt == "chat" else 4)

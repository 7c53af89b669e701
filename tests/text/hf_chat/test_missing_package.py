"""A package the chat template needs (jinja2) missing: the error names the package and the
extra that installs it, never the data, and the refused run leaves no output directory."""

import builtins

import pytest

pytest.importorskip("transformers")

from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.text.hf_chat import render  # noqa: E402
from support import chat_fixtures  # noqa: E402
from support import preference_fixtures  # noqa: E402


def test_missing_jinja2_is_named_with_its_extra_and_leaves_nothing(tmp_path, monkeypatch, capsys):
  tokenizer = chat_fixtures.make_tokenizer(tmp_path / "tok", "qwen2_5")
  path = preference_fixtures.write_jsonl(tmp_path / "chat.jsonl",
                                         chat_fixtures.conversations("qwen2_5", 4))
  real_import = builtins.__import__

  def no_jinja2(name, *args, **kwargs):
    if name == "jinja2" or name.startswith("jinja2."):
      raise ImportError(f"No module named {name!r}", name=name)
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_jinja2)
  with pytest.raises(ImportError, match=r"`jinja2` package, which is not installed: pip install "
                                        r"'segpack\[hf\]'"):
    render._transformers()
  out = tmp_path / "data"
  assert tokenize_cli.main(["--format", "chat", "--input", path, "--tokenizer",
                            f"hf:{tokenizer}", "--output", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "jinja2" in err and "segpack[hf]" in err
  assert "chat.jsonl:" not in err  # not blamed on a record
  assert not out.exists()


def test_an_install_without_torch_is_not_told_about_torch():
  """transformers advises that PyTorch is missing at import; segpack only reads tokenizers and
  templates with it, so a chat tokenize without torch prints no such line."""
  import subprocess
  import sys
  from support import paths
  code = ("import sys; sys.modules['torch'] = None\n"
          "from segpack.text.hf_chat import render\n"
          "render._transformers()\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=paths.REPO, capture_output=True,
                       text=True, timeout=300, env={"PYTHONPATH": str(paths.REPO),
                                                    "PATH": "/usr/bin:/bin"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert "PyTorch was not found" not in out.stderr

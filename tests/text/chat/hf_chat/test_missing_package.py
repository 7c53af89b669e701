"""A package the chat template needs (jinja2) missing: the error names the package and the
extra that installs it, never the data, and the refused run leaves no output directory."""

import builtins

import pytest

pytest.importorskip("transformers")

from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.text.chat.hf_chat import render  # noqa: E402
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
          "from segpack.text.chat.hf_chat import render\n"
          "render._transformers()\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=paths.REPO, capture_output=True,
                       text=True, timeout=300, env={"PYTHONPATH": str(paths.REPO),
                                                    "PATH": "/usr/bin:/bin"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert "PyTorch was not found" not in out.stderr


def _tokenize(python, tmp_path, out):
  """`segpack tokenize --format chat` with the venv's python, from outside the repository."""
  import subprocess
  return subprocess.run([str(python), "-m", "segpack", "tokenize", "--format", "chat", "--input",
                         "chat.jsonl", "--tokenizer", "hf:tok", "--output", out],
                        cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})


@pytest.mark.slow
def test_an_install_of_only_the_hf_extra_tokenizes_chat_data(tmp_path):
  """`pip install ".[hf]"` and nothing else: a venv of just the distributions that install makes
  (support/fresh_env.py) tokenizes chat data with a real template. Negative controls: torch,
  installed here, is absent there; the same venv less jinja2 refuses in one line naming it."""
  import subprocess
  from segpack import shards
  from support import fresh_env
  chat_fixtures.make_tokenizer(tmp_path / "tok", "qwen2_5")
  preference_fixtures.write_jsonl(tmp_path / "chat.jsonl", chat_fixtures.conversations("qwen2_5", 6))
  python = fresh_env.make(tmp_path / "venv", extras=("hf",))
  probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
  assert probe.returncode == 1 and "No module named 'torch'" in probe.stderr
  done = _tokenize(python, tmp_path, "data")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "PyTorch was not found" not in done.stderr + done.stdout
  source = shards.ShardSource(str(tmp_path / "data"))
  assert len(source) == 6 and source.has_loss_mask
  python = fresh_env.make(tmp_path / "venv_no_jinja2", extras=("hf",), drop=("jinja2",))
  refused = _tokenize(python, tmp_path, "data2")
  assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-3000:]
  assert "jinja2" in refused.stderr and "segpack[hf]" in refused.stderr
  assert not (tmp_path / "data2").exists()

"""What `pip install -e .` and `pip install -e ".[hf]"` alone run: venvs of just the
distributions each installs (support/fresh_env.py), used from a new user's directory.

- The base install runs the README's main job (its first command, on the smoke config, fewer
  steps) and imports none of the `[hf]` extra's packages; the README's Hugging Face lines
  (tokenize with `hf:MODEL_DIR`, train from `model.init_from`, export) are refused there in one
  line naming the package and the extra. Negative control: `import safetensors` fails there,
  while the tests' own environment has it.
- The `[hf]` extra alone runs the README's "Fine-tune a Hugging Face model" block (tokenize, train
  from the model, sample, export) on a tiny Qwen3 made here with transformers and torch. Negative
  control: torch, which made the model, is absent there.
"""

import importlib.util
import json
import os
import subprocess

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from support import chat_fixtures  # noqa: E402
from support import doc_blocks  # noqa: E402
from support import fresh_env  # noqa: E402
from support import hf_models  # noqa: E402
from support import paths  # noqa: E402
from support import small_corpus  # noqa: E402
from support.train_configs import run_cli  # noqa: E402

FINE_TUNE = "## Fine-tune a Hugging Face model"
EXTRAS = ("safetensors", "transformers", "tokenizers", "jinja2", "torch")
# What the base install imports for its commands; printed, then the negative control's import.
PROBE = ("import sys\n"
         "import segpack, segpack.cli.main, train.main\n"
         f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({EXTRAS!r})))\n"
         "import safetensors\n")
FEWER = ["--config.train.num_steps=3", "--config.train.eval_every=3",
         "--config.train.batch_size=24",  # the rows of a minibatch of these chats (21)
         "--config.train.checkpoint_every=3", "--config.attention.self_check=False"]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
  """`(directory, env, MODEL_DIR)`: a directory holding `chat.jsonl` (24 conversations of roles
  and contents), the environment naming the tests' shared corpus cache, and a tiny Qwen3 with
  Qwen3's chat template (made here, where transformers and torch are)."""
  home = tmp_path_factory.mktemp("user")
  model_dir, _ = hf_models.make_chat_model(home / "model")
  records = [{"messages": [{"role": m["role"], "content": m["content"]} for m in r["messages"]]}
             for r in chat_fixtures.conversations("qwen3", 48)
             if "tools" not in r and {m["role"] for m in r["messages"]} <= {"system", "user",
                                                                             "assistant"}][:24]
  assert len(records) == 24
  (home / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
  return home, {"SEGPACK_CACHE": str(small_corpus.cache_dir(tmp_path_factory))}, model_dir


def _home(user, name):
  """A new user's directory of its own: `configs/` and `chat.jsonl` linked in."""
  home = user[0] / name
  home.mkdir()
  os.symlink(paths.REPO / "configs", home / "configs")
  os.symlink(user[0] / "chat.jsonl", home / "chat.jsonl")
  return home


def _refused(out, package):
  """The command stopped with rc 2 and one line naming `package` and the `[hf]` extra."""
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.count("\n") == 1, out.stderr[-3000:]
  assert f"`{package}` package" in out.stderr or f"the {package} package" in out.stderr
  assert "segpack[hf]" in out.stderr


@pytest.mark.slow
def test_the_base_install_runs_the_main_job_and_refuses_the_hf_lines_naming_the_extra(
    tmp_path, user):
  home, (_, env, model_dir) = _home(user, "base"), user
  python = fresh_env.make(tmp_path / "venv", extras=())
  probe = subprocess.run([str(python), "-c", PROBE], cwd=home, capture_output=True, text=True,
                         timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(home),
                                           "JAX_PLATFORMS": "cpu"})
  assert probe.stdout.strip() == "[]", probe.stderr[-3000:]  # none of the extra's packages
  assert probe.returncode == 1 and "No module named 'safetensors'" in probe.stderr
  assert importlib.util.find_spec("safetensors") is not None  # here, it is installed
  (first,) = doc_blocks.commands("# segpack")
  assert first == "pip install -e . && python -m train.main --config=configs/packed.py"
  ((_, main_job),) = doc_blocks.run([first], {"configs/packed.py": "configs/packed.py:smoke"},
                                    train_args=["--config.train.num_steps=2"], cwd=home,
                                    env=env, python=python)
  last = main_job.stdout.strip().splitlines()[-5:]  # what next, with this run's workdir
  assert "done in" in last[0] and "runs/packed_smoke holds the run" in last[0], last
  assert [line.split()[:3] for line in last[1:3]] == [
      ["python", "-m", "train.sample"], ["python", "-m", "train.plot"]], last
  run_cli("train.plot", "runs/packed_smoke", cwd=home, env=env, python=python)  # base install
  assert (home / "runs" / "packed_smoke" / "curves.png").stat().st_size > 1000
  records = [json.loads(x) for x in (home / "runs" / "packed_smoke" / "metrics.jsonl").open()]
  assert [r["step"] for r in records if r.get("kind") == "train"] == [1, 2]
  assert records[-1]["kind"] == "summary" and records[-1]["steps"] == 2
  assert np.isfinite(records[-1]["final_eval_loss"])
  tokenize, train, _, export = _fine_tune_lines(model_dir)
  _refused(run_cli(*tokenize, cwd=home, env=env, check=False, python=python), "tokenizers")
  assert not (home / "data" / "chat").exists()
  run_cli(*tokenize, cwd=home, env=env)  # this environment's tokenizers
  _refused(run_cli(*train, *FEWER, cwd=home, env=env, check=False, python=python), "tokenizers")
  export = [w.replace("runs/sft_hf", "runs/packed_smoke") for w in export]
  _refused(run_cli(*export, cwd=home, env=env, check=False, python=python), "safetensors")
  assert not (home / "exported").exists()


def _fine_tune_lines(model_dir):
  """The README's fine-tune block, MODEL_DIR replaced: the words after `python -m` of each."""
  lines = [c.replace("MODEL_DIR", model_dir) for c in doc_blocks.commands(FINE_TUNE)]
  words = [doc_blocks.python_m(c)[0] for c in lines]
  assert len(words) == 4 and [w[0] for w in words[:2]] == ["segpack", "train.main"]
  assert "--workdir" in words[2] and "--output" in words[3]  # sample, export
  return words


@pytest.mark.slow
def test_the_hf_extra_alone_runs_the_fine_tune_block(tmp_path, user):
  home, (_, env, model_dir) = _home(user, "hf"), user
  python = fresh_env.make(tmp_path / "venv", extras=("hf",))
  probe = subprocess.run([str(python), "-c", "import safetensors, tokenizers, transformers\n"
                          "import torch"], cwd=home, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(home)})
  assert probe.returncode == 1 and "No module named 'torch'" in probe.stderr, probe.stderr
  _fine_tune_lines(model_dir)
  commands = doc_blocks.commands(FINE_TUNE)
  outs = [out for _, out in doc_blocks.run(commands, {"MODEL_DIR": model_dir}, train_args=FEWER,
                                           cwd=home, env=env, python=python)]
  summary = [json.loads(x) for x in (home / "runs" / "sft_hf" / "metrics.jsonl").open()][-1]
  assert summary["kind"] == "summary" and summary["steps"] == 3
  assert "recipe: fine-tuning (model.init_from)" in outs[1].stdout
  assert outs[2].stdout.startswith("=== prompt 1, sample 1/1 (greedy)")
  for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
    assert (home / "exported" / name).is_file(), name

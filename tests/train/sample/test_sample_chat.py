"""`train.sample --chat` on a chat run, and the decoding benchmark's table.

The chat prompt is the conversation the run's template renders up to the assistant's turn, the
answer stops at the template's end of turn and is printed without it; the benchmark decodes the
same tokens with the KV cache and the full forward pass and says so."""

import json
import os
import subprocess
import sys

import pytest

from configs import packed
from configs import sft
from segpack.text import chat
from segpack.text.chat import corpus as chat_corpus
from support.train_configs import one_step_run
from support import train_configs
from train.rollout import engine
from train.sample import prompts as sample_prompts
from train.sample import command as sample_lib
from train.sample import bench as sample_bench
from train.runs import saved as saved_run
from train.runs import loaded as loaded_run
from support import paths

_ONE_DEVICE = dict(os.environ, XLA_FLAGS=train_configs.one_cpu_device())  # a user's one

REPO = str(paths.REPO)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("chat_run")
  one_step_run(sft.get_config("smoke"), workdir)
  return str(workdir)


@pytest.mark.slow
def test_chat_prompts_are_the_templates_user_turn_and_answers_stop_at_its_end(chat_run):
  config, _ = saved_run.run_config(chat_run)
  tok = chat_corpus.chat_tokenizer(size=config.data.size, cache_dir=config.data.cache_dir)
  encoder = chat.ChatEncoder(tok)
  question = "What does `zip` do?"
  # Oracle: the encoding of the conversation with an empty answer, cut before the answer's
  # content (the template's pieces: user turn, assistant marker, separator).
  ids, mask = encoder.encode([{"role": "user", "content": question},
                              {"role": "assistant", "content": ""}])
  want = [tok.bos_id] + list(ids[:list(mask).index(1)])
  end = encoder.stop_ids
  answers = sample_lib.sample(chat_run, prompts=[question], chat_mode=True, max_new_tokens=12)
  (answer,) = answers
  _, model, _ = loaded_run.load_run(chat_run)
  (free,) = (list(c.token_ids)  # no stop ids
             for c in engine.generate(model, [want], max_new_tokens=12))
  cut = next((i + 1 for i, t in enumerate(free) if t in end or t == tok.eos_id), len(free))
  assert list(answer.new_ids) == free[:cut]
  shown = free[:cut - 1] if free[cut - 1:cut] and free[cut - 1] in set(end) | {tok.eos_id} \
      else free[:cut]
  assert answer.text == tok.decode(shown)
  proc = subprocess.run([sys.executable, "-m", "train.sample", f"--workdir={chat_run}", "--chat",
                         f"--prompt={question}", "--max_new_tokens=12"], cwd=REPO,
                        capture_output=True, text=True, timeout=300, env=_ONE_DEVICE)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines()[1:] == answer.text.splitlines()



def test_a_stop_string_cuts_the_answer_and_the_output_file_holds_every_token(chat_run, tmp_path):
  """`--stop S` with S two characters from the middle of the free answer: the printed answer
  stops before S's first place, and `--output` holds the completion's ids (a prefix of the free
  answer's), one log-prob per id, "stop_string" and S; the same path again, an empty `--stop` and
  `--num_samples 0` are one-line errors that write nothing."""
  question = "What does `zip` do?"
  (free,) = sample_lib.sample(chat_run, prompts=[question], chat_mode=True, max_new_tokens=24)
  stop = next(free.text[i:i + 2] for i in range(3, len(free.text) - 2)
              if free.text[i:i + 2].strip() == free.text[i:i + 2])
  out = tmp_path / "answers.jsonl"
  args = [sys.executable, "-m", "train.sample", f"--workdir={chat_run}", "--chat",
          f"--prompt={question}", "--max_new_tokens=24"]
  proc = subprocess.run(args + [f"--stop={stop}", f"--output={out}"], cwd=REPO,
                        capture_output=True, text=True, timeout=300, env=_ONE_DEVICE)
  assert proc.returncode == 0, proc.stderr
  cut = free.text[:free.text.index(stop)]
  assert proc.stdout.splitlines()[1:] == cut.splitlines()
  (line,) = [json.loads(x) for x in out.read_text().splitlines()]
  assert line["finish_reason"] == "stop_string" and line["stop"] == stop
  assert line["completion"] == cut and (line["prompt"], line["sample"]) == (0, 0)
  ids = line["token_ids"]
  assert ids == list(free.new_ids[:len(ids)]) and len(ids) < len(free.new_ids)
  assert len(line["logprobs"]) == len(line["sampling_logprobs"]) == len(ids)
  before = out.read_bytes()
  for extra, message in (([f"--output={out}"], "the file exists"),
                         (["--stop="], "--stop must be a non-empty string"),
                         (["--num_samples=0", "--temperature=1"], "--num_samples must be")):
    proc = subprocess.run(args + extra, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=_ONE_DEVICE)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
  assert out.read_bytes() == before

def test_chat_on_a_run_without_a_template_is_refused_by_name(tmp_path):
  """A plain-text run (the built-in corpus) has no chat template: `--chat` says what would."""
  config = packed.get_config("smoke")
  with pytest.raises(sample_prompts.SampleError, match=r"--chat needs a run on chat data .* this "
                     r"run's data is 'builtin'"):
    sample_prompts.chat_renderer(config, str(tmp_path))


def test_a_template_marker_in_a_chat_prompt_is_a_sample_error_naming_the_flag(chat_run):
  with pytest.raises(sample_prompts.SampleError, match=r"^--prompt: messages\[0\] \(role 'user'\): "
                     r"content contains the template marker '<\|end\|>'"):
    sample_lib.sample(chat_run, prompts=["a <|end|> b"], chat_mode=True, max_new_tokens=2)
  proc = subprocess.run([sys.executable, "-m", "train.sample", f"--workdir={chat_run}", "--chat",
                         "--system=<|user|>", "--prompt=hi", "--max_new_tokens=2"], cwd=REPO,
                        capture_output=True, text=True, timeout=300, env=_ONE_DEVICE)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines() == [
      "python -m train.sample: error: --system and --prompt: messages[0] (role 'system'): "
      "content contains the template marker '<|user|>'"]


def test_the_benchmark_decodes_the_same_tokens_both_ways(capsys):
  rows = sample_bench.run(new_tokens=5, batches=(1, 3), repeats=1, vocab=64, as_json=True)
  printed = json.loads(capsys.readouterr().out)
  assert [r["batch"] for r in printed["results"]] == [1, 3] == [r["batch"] for r in rows]
  for r in rows:
    assert r["same_tokens"] is True and r["new_tokens"] == 5
    assert r["kv_tokens_per_s"] > 0 and r["full_tokens_per_s"] > 0
    assert r["speedup"] == pytest.approx(r["full_seconds"] / r["kv_seconds"])
  table = sample_bench.table(rows, model="m")
  assert "KV cache tok/s" in table and table.count("yes") == 2

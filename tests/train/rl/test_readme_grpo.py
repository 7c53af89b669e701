"""The README's "Reinforcement learning with verifiable rewards" block, run as a new user would
on a tiny Llama made here with the toy task's tokenizer (`support.rl_toy`), with fewer steps:
the run samples, rewards and keeps its rollouts, `train.sample` answers, and the exported model
loads in transformers."""

import json
import os

import pytest

pytest.importorskip("transformers")

from support import doc_blocks  # noqa: E402
from support import hf_models  # noqa: E402
from support import rl_toy  # noqa: E402


def test_readme_grpo_commands(tmp_path):
  import transformers
  commands = doc_blocks.commands("## Reinforcement learning with verifiable rewards")
  assert [c.split()[2] for c in commands] == ["segpack", "train.main", "train.sample",
                                              "train.export"]
  exported = hf_models.make_model(str(tmp_path / "exported"), "llama", vocab_size=32)
  rl_toy.make_tokenizer(exported)
  prompts = rl_toy.write_prompts(str(tmp_path / "prompts.jsonl"), 60, seed=2)
  subs = {"prompts.jsonl": prompts, "data/prompts": str(tmp_path / "prompts"),
          "runs/grpo": str(tmp_path / "run"), "grpo_model": str(tmp_path / "grpo_model"),
          "exported": exported}
  fewer = ["--config.train.num_steps=2", "--config.train.eval_every=2",
           "--config.rl.num_generations=4", "--config.rl.prompts_per_step=2",
           "--config.rl.max_completion_length=4", "--config.packing.seq_len=256",
           "--config.attention.self_check=False"]
  outs = {args[0]: out for args, out in doc_blocks.run(commands, subs, train_args=fewer)}
  assert "2 prompts x 4 completions of up to 4 tokens a round" in outs["train.main"].stdout
  assert "=== prompt 1, sample 1/1" in outs["train.sample"].stdout
  records = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
  train = [r for r in records if r["kind"] == "train"]
  assert train[-1]["step"] == 2 and all("reward" in r for r in train)
  assert [r["kind"] for r in records].count("eval") == 2  # step 0 and step 2
  assert sorted(os.listdir(tmp_path / "run" / "rollouts"))[0] == "round-000000.jsonl"
  _, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "grpo_model"),
                                                              output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info

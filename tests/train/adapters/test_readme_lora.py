"""The README's "Fine-tune with LoRA" block, run as a new user would on a tiny model made here
(chat data tokenized as the block before it does), with fewer steps: the QLoRA run trains, the
sampler answers, `peft` loads the adapter export onto the base and transformers loads the
merged export, with the same logits."""

import json
import re

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from support import hf_models  # noqa: E402
from support import doc_blocks  # noqa: E402
from support.train_configs import run_cli  # noqa: E402


def test_readme_lora_commands(tmp_path):
  import torch
  import transformers
  commands = doc_blocks.commands("## Fine-tune with LoRA")
  assert commands[0].startswith("python -m train.main --config=configs/sft.py")
  assert "--config.model.lora.rank=16" in commands[0] and "base_dtype=nf4" in commands[0]
  assert [c.split()[2] for c in commands[1:]] == ["train.sample", "train.export",
                                                  "train.export"]
  model_dir = hf_models.make_tokenizer(hf_models.make_model(str(tmp_path / "model"), "llama",
                                                            intermediate_size=128))
  hf_models.write_chat_jsonl(str(tmp_path / "chat.jsonl"), 60, seed=1)
  run_cli("segpack", "tokenize", "--input", str(tmp_path / "chat.jsonl"), "--tokenizer",
          f"hf:{model_dir}", "--output", str(tmp_path / "data" / "chat"))
  subs = {"MODEL_DIR": model_dir, "data/chat": str(tmp_path / "data" / "chat"),
          "runs/qlora": str(tmp_path / "run"), "--output adapter": f"--output {tmp_path}/adapter",
          "--output merged": f"--output {tmp_path}/merged"}
  fewer = [
      "--config.train.num_steps=3", "--config.train.eval_every=3",
      "--config.train.batch_size=8", "--config.train.learning_rate=0.02",
      "--config.train.checkpoint_every=3", "--config.attention.self_check=False"]
  for args, out in doc_blocks.run(commands, subs, train_args=fewer):
    if args[0] == "train.main":
      assert re.search(r"model: llama, [\d,]+ trained parameters \(LoRA rank 16, alpha 16, on "
                       r"all\) over a frozen base of [\d,]+ \(nf4\)", out.stdout), out.stdout
      assert "recipe: LoRA fine-tuning (model.init_from)" in out.stdout
    if args[0] == "train.sample":
      assert out.stdout.strip()
  summary = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
  assert summary["kind"] == "summary" and summary["steps"] == 3
  assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 16
  base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
  merged, info = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "merged"), dtype=torch.float32, output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  ids = torch.as_tensor(hf_models.documents(1, lengths=[40], seed=3)[0][None])
  with torch.no_grad():
    a, b = adapted(input_ids=ids).logits.numpy(), merged.eval()(input_ids=ids).logits.numpy()
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(
        input_ids=ids).logits.numpy()
  np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
  assert np.abs(a - plain).max() > 1e-3  # the adapters moved the model

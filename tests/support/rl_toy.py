"""The RL tests' toy task: find the digit in a prompt of filler words (`w3 w0 7 =` -> `7`),
rewarded by exact match, with a word-level tokenizer of 28 tokens (so that a random model
answers right about once in 25 draws), written as prompts datasets by `segpack tokenize`."""

import json
import os
import random

from segpack.cli import tokenize as tokenize_cli

WORDS = [f"w{i}" for i in range(12)]
DIGITS = [str(d) for d in range(10)]


def make_tokenizer(directory: str) -> str:
  import tokenizers
  import transformers
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
  for t in DIGITS + WORDS + ["=", "####"]:
    vocab[t] = len(vocab)
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
      unk_token="<unk>").save_pretrained(directory)
  return directory


def write_prompts(path: str, n: int, *, seed: int) -> str:
  rng = random.Random(seed)
  with open(path, "w", encoding="utf-8") as f:
    for i in range(n):
      d = rng.randrange(10)
      filler = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
      f.write(json.dumps({"prompt": f"{filler} {d} =", "answer": str(d), "id": i}) + "\n")
  return path


def make_datasets(root: str) -> dict[str, str]:
  """`{"tokenizer", "train", "held"}`: 400 training and 100 held-out prompts, tokenized."""
  tok = make_tokenizer(os.path.join(root, "tok"))
  out = {"tokenizer": tok}
  for name, n, seed in (("train", 400, 0), ("held", 100, 1)):
    jsonl = write_prompts(os.path.join(root, f"{name}.jsonl"), n, seed=seed)
    out[name] = os.path.join(root, name)
    assert tokenize_cli.main(["--input", jsonl, "--output", out[name], "--format", "prompts",
                              "--tokenizer", f"hf:{tok}", "--no-progress"]) == 0
  return out


def config(data: dict[str, str], **keys):
  """configs/grpo.py:smoke on the toy: one-token answers, 16 prompts x 8 a round, 8 rows of 64."""
  from configs import grpo
  c = grpo.get_config("smoke")
  c.data.train, c.data.eval = data["train"], data["held"]
  c.rl.max_completion_length, c.rl.num_generations, c.rl.prompts_per_step = 1, 8, 16
  c.rl.rewards = "exact"
  c.packing.seq_len, c.train.batch_size = 64, 8
  c.train.learning_rate, c.train.checkpoint_every, c.train.log_every = 3e-3, 0, 1
  c.train.eval_every, c.train.eval_batches = 0, 0
  for key, value in keys.items():
    group, name = key.split("__")
    c[group][name] = value
  return c

"""Tiny Hugging Face models and tokenizers made here with transformers (never downloaded), and
transformers' own logits and losses as the oracle for segpack's import and export."""

from __future__ import annotations

import json
import os

import numpy as np

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
HIDDEN, HEADS, HEAD_DIM, LAYERS, FFN = 64, 4, 16, 2, 96


def hf_config(family: str, *, vocab_size: int = 160, kv_heads: int = 2, tie: bool = False,
              rope: dict | None = None, **extra):
  """A transformers config object of `family` with tiny sizes (weights std 0.2: attention
  patterns are far from uniform, so a RoPE or layout mistake moves the logits a lot)."""
  import transformers
  cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
         "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
  kwargs = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                num_hidden_layers=LAYERS, intermediate_size=FFN, vocab_size=vocab_size,
                max_position_embeddings=4096, initializer_range=0.2, rms_norm_eps=1e-6,
                tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
  if family == "qwen3":
    kwargs["head_dim"] = HEAD_DIM
  if family == "mistral":
    kwargs["sliding_window"] = None
  if rope is not None:
    kwargs["rope_parameters"] = dict(rope)
  kwargs.update(extra)
  return cls(**kwargs)


def make_model(directory: str, family: str = "llama", *, seed: int = 0, dtype: str = "float32",
               max_shard_size: str | None = None, **config_kwargs) -> str:
  """Saves a random `family` model made by transformers to `directory`; returns it."""
  import torch
  import transformers
  torch.manual_seed(seed)
  config = hf_config(family, **config_kwargs)
  model = transformers.AutoModelForCausalLM.from_config(config)
  with torch.no_grad():  # non-trivial norms and biases, so a dropped tensor shows
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.3 * torch.randn_like(p))
  model = model.to(getattr(torch, dtype))
  kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
  model.save_pretrained(directory, **kwargs)
  return directory


def make_chat_model(directory) -> tuple[str, object]:
  """A tiny Qwen3 (E=32, 2 layers) with Qwen3's chat template and vocabulary
  (`chat_fixtures.make_tokenizer`) saved to `directory`, the README's MODEL_DIR in the tests of
  its fine-tune block; returns `(directory, its transformers tokenizer)`."""
  import transformers
  from support import chat_fixtures
  model_dir = chat_fixtures.make_tokenizer(directory, "qwen3")
  tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
  make_model(str(model_dir), "qwen3", vocab_size=len(tok), hidden_size=32, head_dim=8,
             intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
  return str(model_dir), tok


TOKENS = [f"w{i}" for i in range(150)]


CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")  # segpack's ChatTemplate


def make_tokenizer(directory: str, *, eos: str = "</s>") -> str:
  """A word-level `tokenizer.json` + `tokenizer_config.json` (pad 0, BOS 1, EOS 2, unk 3, 150
  words `w0`..`w149` as ids 4..153, segpack's four chat markers as added tokens 154..157: 158
  tokens, fewer than the models' 160 embedding rows) saved with transformers'
  `PreTrainedTokenizerFast` into `directory`."""
  import tokenizers
  import transformers
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
  vocab.update({t: i + 4 for i, t in enumerate(TOKENS)})
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token=eos, pad_token="<pad>", unk_token="<unk>",
      additional_special_tokens=list(CHAT_MARKERS))
  fast.save_pretrained(directory)
  return directory


def write_chat_jsonl(path: str, n: int, *, seed: int = 0) -> str:
  """`n` conversations (an optional system prompt, 1-3 user/assistant turns) of random words."""
  rng = np.random.default_rng(seed)

  def words(k):
    return " ".join(TOKENS[i] for i in rng.integers(0, len(TOKENS), size=k))

  with open(path, "w", encoding="utf-8") as f:
    for _ in range(n):
      messages = [{"role": "system", "content": words(5)}] if rng.random() < 0.3 else []
      for _ in range(int(rng.integers(1, 4))):
        messages += [{"role": "user", "content": words(int(rng.integers(3, 30)))},
                     {"role": "assistant", "content": words(int(rng.integers(3, 60)))}]
      f.write(json.dumps({"messages": messages}) + "\n")
  return path


def write_text_jsonl(path: str, n: int, *, seed: int = 0) -> str:
  """`n` plain documents of 5-200 random words, `{"text": ...}` per line."""
  rng = np.random.default_rng(seed)
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(n):
      k = int(rng.integers(5, 200))
      f.write(json.dumps({"text": " ".join(TOKENS[i] for i in rng.integers(0, 150, size=k))})
              + "\n")
  return path


def documents(n: int, *, lengths: list[int], seed: int = 0, vocab: int = 154) -> list[np.ndarray]:
  """`n` random token documents of the given lengths, ids in [4, vocab) (no special ids)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(4, vocab, size=lengths[i % len(lengths)]).astype(np.int64)
          for i in range(n)]


def transformers_logits(model_dir: str, ids: np.ndarray) -> np.ndarray:
  """transformers' float32 logits `[S, V]` of one document run alone (torch, CPU)."""
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  model.eval()
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(np.asarray(ids)[None], dtype=torch.long))
  return out.logits[0].float().numpy()


def transformers_token_losses(model_dir: str, docs: list[np.ndarray]) -> np.ndarray:
  """Every next-token loss of every document run alone, concatenated (float64)."""
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  model.eval()
  out = []
  with torch.no_grad():
    for ids in docs:
      x = torch.as_tensor(np.asarray(ids)[None], dtype=torch.long)
      logits = model(input_ids=x).logits[0, :-1].double()
      out.append(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none").numpy())
  return np.concatenate(out)


def read_json(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def write_json(path: str, value: dict) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2)
  assert os.path.isfile(path)

"""`train.rollout.engine` on imported Hugging Face models against transformers: greedy answers of
several prompts of different lengths, decoded together (a lane each, one lane, two lanes), equal
`model.generate(do_sample=False)` on the left-padded batch, token for token; stopping at EOS
agrees too; drawn tokens' log-probs are transformers' `log_softmax` of the logits at their
positions."""

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from support import hf_models  # noqa: E402
from configs import packed  # noqa: E402
from train.rollout import engine  # noqa: E402
from train.rollout import sampling as sampling_lib  # noqa: E402
from train.hf import config as hf_config, weights as hf_weights  # noqa: E402
from train import sharding as sharding_lib  # noqa: E402

NEW = 16


def _imported(model_dir):
  config = packed.get_config()
  config.model.init_from = model_dir
  config.attention.implementation = "xla"
  hf_config.adopt(config)
  return hf_weights.load_decoder(config, mesh=sharding_lib.make_mesh())


def _transformers_greedy(model_dir, prompts, *, eos=None):
  """transformers' greedy `generate` on the batch, left-padded with an attention mask; the new
  tokens of each prompt, cut after EOS (transformers pads finished rows with pad_token_id)."""
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  width = max(len(p) for p in prompts)
  ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                         min_new_tokens=0, eos_token_id=eos, pad_token_id=0, top_k=None,
                         top_p=None, temperature=None)
  answers = []
  for row in out[:, width:].tolist():
    answers.append(row[:row.index(eos) + 1] if eos is not None and eos in row else row)
  return answers


def _ids(completions):
  return [list(c.token_ids) for c in completions]


def _prompts(seed):
  rng = np.random.default_rng(seed)
  return [[1] + [int(t) for t in rng.integers(3, 150, size=n - 1)] for n in (3, 17, 8, 31, 1)]


@pytest.mark.parametrize("family, tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_greedy_batch_equals_transformers_generate(tmp_path, family, tie):
  model_dir = hf_models.make_model(str(tmp_path / "m"), family, tie=tie)
  model = _imported(model_dir)
  prompts = _prompts(0)
  want = _transformers_greedy(model_dir, prompts)
  assert len({tuple(w) for w in want}) == len(prompts)  # distinct answers: nothing shared
  for lanes in (None, 1, 2):
    assert _ids(engine.generate(model, prompts, max_new_tokens=NEW, lanes=lanes)) == want


def test_stopping_at_eos_equals_transformers(tmp_path):
  """An EOS id that some answers reach (picked from transformers' own answers): each answer ends
  at its first EOS, as transformers' does, and the others run on."""
  model_dir = hf_models.make_model(str(tmp_path / "m"), "llama", seed=3)
  model = _imported(model_dir)
  prompts = _prompts(1)
  free = _transformers_greedy(model_dir, prompts)
  eos = free[1][5]  # a token that answer 1 reaches after 5 others
  want = _transformers_greedy(model_dir, prompts, eos=eos)
  assert want[1] == free[1][:free[1].index(eos) + 1]
  assert any(eos not in w for w in want)  # the negative: some run the whole way
  assert _ids(engine.generate(model, prompts, max_new_tokens=NEW, stop_ids=[eos], lanes=1)) == want


def test_drawn_logprobs_are_transformers_log_softmax(tmp_path):
  """Temperature 1, no truncation, 4 samples of each prompt: every token's log-prob equals
  transformers' `log_softmax` of the exported-format model's logits at that position (float32,
  1e-4), and so does the log-prob of the distribution drawn from (the same one here)."""
  import transformers
  model_dir = hf_models.make_model(str(tmp_path / "m"), "qwen3", seed=5)
  model = _imported(model_dir)
  prompts = _prompts(2)[:3]
  got = engine.generate(model, prompts, num_samples=4, max_new_tokens=10, seed=3,
                        sampling=sampling_lib.Sampling(temperature=1.0))
  hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  assert len({c.token_ids for c in got}) > 4  # real draws, not one answer repeated
  for c in got:
    row = prompts[c.prompt] + list(c.token_ids)
    with torch.no_grad():
      logits = hf(input_ids=torch.tensor([row])).logits[0].double()
    logp = torch.log_softmax(logits, -1)[len(prompts[c.prompt]) - 1:-1]
    want = logp[torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)].numpy()
    np.testing.assert_allclose(c.logprobs, want, atol=1e-4)
    np.testing.assert_allclose(c.sampling_logprobs, want, atol=1e-4)

"""The RL objective's loss and gradient norm of one step against TRL's `GRPOTrainer` (its own
`_compute_loss`, padded, float32) on the same tiny model, fixed completions, advantages and old
and reference log-probs: grpo, dr_grpo and dapo, with and without the KL term. segpack's side
is the trainer's loss (`RLObjective.loss_and_sums`) on packed rows with each prompt stored once."""

import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from configs import grpo  # noqa: E402
from segpack.data import groups as group_rows_lib  # noqa: E402
from segpack.packing import groups as groups_lib  # noqa: E402
from support import hf_models  # noqa: E402
from train import sharding as sharding_lib  # noqa: E402
from train.hf import config as hf_config, weights as hf_weights  # noqa: E402
from train.rl import objective as rl_objective  # noqa: E402

G, MAX_NEW = 3, 8
PROMPTS = 2


@pytest.fixture(scope="module")
def case(tmp_path_factory):
  """A tiny Llama, 2 prompts of 6 tokens with 3 completions each, advantages, and old and
  reference log-probs that differ from the model's (ratios away from 1, some clipped)."""
  model_dir = hf_models.make_model(str(tmp_path_factory.mktemp("m") / "llama"), "llama")
  rng = np.random.default_rng(3)
  prompts = [[1] + [int(t) for t in rng.integers(3, 150, size=5)] for _ in range(PROMPTS)]
  completions = [[[int(t) for t in rng.integers(3, 150, size=n)] for n in ns]
                 for ns in ([3, 8, 5], [7, 2, 6])]
  adv = rng.normal(size=(PROMPTS, G)).astype(np.float32)
  true = _transformers_logps(model_dir, prompts, completions)
  old = [[t + rng.normal(scale=0.3, size=t.size).astype(np.float32) for t in ts] for ts in true]
  ref = [[t + rng.normal(scale=0.5, size=t.size).astype(np.float32) for t in ts] for ts in true]
  return dict(model_dir=model_dir, prompts=prompts, completions=completions, adv=adv, old=old,
              ref=ref)


def _transformers_logps(model_dir, prompts, completions):
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  out = []
  for prompt, comps in zip(prompts, completions):
    row = []
    for comp in comps:
      ids = torch.tensor([prompt + comp])
      with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
      at = torch.arange(len(prompt) - 1, len(prompt) + len(comp) - 1)
      row.append(logp[at, torch.tensor(comp)].numpy().astype(np.float32))
    out.append(row)
  return out


def _padded(case):
  """TRL's inputs: prompts (all one length), completions right-padded with their mask."""
  flat = [(p, c, case["adv"][g, k], case["old"][g][k], case["ref"][g][k])
          for g, p in enumerate(case["prompts"]) for k, c in enumerate(case["completions"][g])]
  width = max(len(c) for _, c, *_ in flat)

  def pad(x, value=0.0):
    return list(x) + [value] * (width - len(x))

  mask = torch.tensor([pad([1] * len(c), 0) for _, c, *_ in flat])
  return dict(prompt_ids=torch.tensor([p for p, *_ in flat]),
              prompt_mask=torch.ones(len(flat), len(flat[0][0]), dtype=torch.long),
              completion_ids=torch.tensor([pad(c, 0) for _, c, *_ in flat]),
              completion_mask=mask, advantages=torch.tensor([a for *_, a, _, _ in flat]),
              old_per_token_logps=torch.tensor([pad(o) for *_, o, _ in flat]),
              ref_per_token_logps=torch.tensor([pad(r) for *_, r in flat]),
              num_items_in_batch=mask.sum())


def _trl(case, *, loss_type, beta, tmp_path):
  import datasets
  import transformers
  import trl
  model = transformers.AutoModelForCausalLM.from_pretrained(case["model_dir"],
                                                            dtype=torch.float32)
  tokenizer = hf_models.make_tokenizer(str(tmp_path / "tok"))
  args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=G * PROMPTS,
                        num_generations=G, max_completion_length=MAX_NEW, loss_type=loss_type,
                        beta=beta, epsilon=0.2, epsilon_high=0.28 if loss_type == "dapo" else None,
                        use_cpu=True, bf16=False, report_to=[], logging_steps=1)
  trainer = trl.GRPOTrainer(
      model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
      train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * G * PROMPTS),
      processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer))
  trainer.current_gradient_accumulation_steps = 1
  trainer.model.train()
  loss = trainer._compute_loss(trainer.model, _padded(case))
  loss.backward()
  norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in trainer.model.parameters()
                       if p.grad is not None))
  return float(loss), norm


def _segpack(case, *, loss_type, beta, layout="shared"):
  config = grpo.get_config()
  config.model.init_from = case["model_dir"]
  config.attention.implementation = "xla"
  config.rl.loss, config.rl.beta = loss_type, beta
  config.rl.num_generations, config.rl.max_completion_length = G, MAX_NEW
  hf_config.adopt(config)
  mesh = sharding_lib.make_mesh()
  model = hf_weights.load_decoder(config, mesh=mesh)
  plan = groups_lib.plan_groups(prompt_lengths=[len(p) for p in case["prompts"]],
                                completion_lengths=[[len(c) for c in cs]
                                                    for cs in case["completions"]],
                                seq_len=64, layout=layout)
  rows = group_rows_lib.group_rows(
      plan, prompts=case["prompts"], completions=case["completions"],
      completion_values={"advantages": case["adv"]},
      token_values={"old_logp": case["old"], "reference_logp": case["ref"]},
      num_rows=len(jax.devices()))
  objective = rl_objective.from_config(config)
  batch = sharding_lib.global_batch(rows, mesh)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p):
    m = nnx.merge(graphdef, p, rest)
    return objective.loss_and_sums(m, batch, objective.normalizer(batch))[0]

  with jax.set_mesh(mesh):
    loss, norm = jax.jit(lambda p: (lambda lg: (lg[0], optax.global_norm(lg[1])))(
        jax.value_and_grad(loss_fn)(p)))(params)
  return float(loss), float(norm), plan


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_one_step_equals_trl_grpo_trainer(case, tmp_path, loss_type, beta):
  want_loss, want_norm = _trl(case, loss_type=loss_type, beta=beta, tmp_path=tmp_path)
  loss, norm, plan = _segpack(case, loss_type=loss_type, beta=beta)
  assert plan.num_rows == 1 and plan.stats["slots_saved"] == PROMPTS * (G - 1) * 5
  assert abs(want_loss) > 1e-3 and want_norm > 1e-3  # not a trivial step
  assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
  assert abs(norm - want_norm) <= 1e-5 * want_norm, (norm, want_norm)


def test_the_loss_types_differ_and_copying_the_prompt_changes_nothing(case):
  """Negative controls: the three normalisers give three losses (so each comparison above
  checks its own); the prompt copied per completion gives the prompt-once numbers."""
  losses = {t: _segpack(case, loss_type=t, beta=0.0)[0] for t in ("grpo", "dr_grpo", "dapo")}
  assert len({round(v, 6) for v in losses.values()}) == 3, losses
  copied = _segpack(case, loss_type="grpo", beta=0.04, layout="copied")
  shared = _segpack(case, loss_type="grpo", beta=0.04)
  assert copied[2].stats["slots_saved"] == 0
  np.testing.assert_allclose(copied[:2], shared[:2], rtol=1e-5)

"""Groups packed with each prompt stored once: every completion's per-token log-probs on the
packed rows equal transformers' for prompt + completion run alone; a branch that sees a sibling
(the negative control) changes them; over random group sizes and lengths no group is split
and every completion token is trained exactly once."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from configs import packed  # noqa: E402
from segpack.data import groups as group_rows_lib  # noqa: E402
from segpack.loss.labels import IGNORE_INDEX  # noqa: E402
from segpack.packing import groups as groups_lib  # noqa: E402
from support import hf_models  # noqa: E402
from train import sharding as sharding_lib  # noqa: E402
from train.hf import config as hf_config, weights as hf_weights  # noqa: E402
from train.model import head_loss  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return hf_models.make_model(str(tmp_path_factory.mktemp("m") / "qwen3"), "qwen3")


@pytest.fixture(scope="module")
def decoder(model_dir):
  config = packed.get_config()
  config.model.init_from = model_dir
  config.attention.implementation = "xla"
  hf_config.adopt(config)
  mesh = sharding_lib.make_mesh()
  return hf_weights.load_decoder(config, mesh=mesh), mesh


def _alone(model_dir, prompt, completion):
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  with torch.no_grad():
    logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].double(), -1)
  at = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
  return logp[at, torch.tensor(completion)].numpy()


def _packed_logps(decoder, rows):
  model, mesh = decoder
  graphdef, params = nnx.split(model)
  with jax.set_mesh(mesh):
    batch = sharding_lib.global_batch(rows, mesh)
    return np.asarray(jax.jit(lambda p, b: -head_loss.token_losses(
        nnx.merge(graphdef, p), b, block_size=0))(params, batch))


def _per_completion(rows, logp_BxS):
  out = {}
  labelled = rows["labels"] != IGNORE_INDEX
  for n in np.unique(rows["completion_index"][labelled]):
    out[int(n)] = logp_BxS[(rows["completion_index"] == n) & labelled]
  return out


def test_each_completion_on_packed_rows_equals_transformers_alone(model_dir, decoder):
  rng = np.random.default_rng(0)
  prompts = [[1] + [int(t) for t in rng.integers(3, 150, size=n)] for n in (4, 11, 1, 7)]
  completions = [[[int(t) for t in rng.integers(3, 150, size=m)] for m in ms]
                 for ms in ([5, 2, 9], [3, 3], [6, 1, 4, 2], [8])]
  plan = groups_lib.plan_groups(prompt_lengths=[len(p) for p in prompts],
                                completion_lengths=[[len(c) for c in cs] for cs in completions],
                                seq_len=48)
  assert plan.num_rows >= 2 and plan.stats["slots_saved"] > 0
  rows = group_rows_lib.group_rows(plan, prompts=prompts, completions=completions,
                                   num_rows=len(jax.devices()))
  got = _per_completion(rows, _packed_logps(decoder, rows))
  flat = [(p, c) for p, cs in zip(prompts, completions) for c in cs]
  assert sorted(got) == list(range(len(flat)))
  for n, (p, c) in enumerate(flat):
    np.testing.assert_allclose(got[n], _alone(model_dir, p, c), rtol=1e-5, atol=1e-6)
  # Negative control: the second branch of a group also sees its sibling (its segment id
  # made the first branch's): its numbers change.
  leaky = {k: v.copy() for k, v in rows.items()}
  r = 0
  segs = [s for s in np.unique(leaky["segment_ids"][r]) if s]
  first, second = segs[1], segs[2]
  assert (leaky["prefix_segment_ids"][r][leaky["segment_ids"][r] == second] != 0).all()
  leaky["segment_ids"][r][leaky["segment_ids"][r] == second] = first
  target = int(rows["completion_index"][r][(rows["segment_ids"][r] == second)
                                           & (rows["labels"][r] != IGNORE_INDEX)][0])
  changed = _per_completion(leaky, _packed_logps(decoder, leaky))
  assert not np.allclose(changed[target], got[target], atol=1e-3)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_no_group_is_split_and_every_completion_token_is_trained_once(data):
  layout = data.draw(st.sampled_from(groups_lib.LAYOUTS))
  seq_len = data.draw(st.integers(24, 96))
  n = data.draw(st.integers(1, 12))
  prompts, completions = [], []
  for g in range(n):
    p = data.draw(st.integers(1, 8))
    ms = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    if groups_lib.group_slots(p, ms, layout=layout) > seq_len:
      continue
    prompts.append([1000 + g] * p)
    completions.append([[2000 + 10 * g + k] * m for k, m in enumerate(ms)])
  if not prompts:
    return
  plan = groups_lib.plan_groups(prompt_lengths=[len(p) for p in prompts],
                                completion_lengths=[[len(c) for c in cs] for cs in completions],
                                seq_len=seq_len, layout=layout)
  rows = group_rows_lib.group_rows(plan, prompts=prompts, completions=completions)
  row_of_group = {}
  for r in range(plan.num_rows):
    for g in set(plan.group[plan.row_splits[r]:plan.row_splits[r + 1]].tolist()):
      assert row_of_group.setdefault(g, r) == r  # a group lies in one row
  assert sorted(row_of_group) == list(range(len(prompts)))
  flat = [c for cs in completions for c in cs]
  for k, c in enumerate(flat):  # each completion token is some slot's label, exactly once
    mask = rows["completion_index"] == k
    assert rows["labels"][mask].tolist() == c
  assert np.count_nonzero(rows["labels"] != IGNORE_INDEX) == sum(len(c) for c in flat)
  assert (rows["segment_ids"] != 0).sum(axis=1).max() <= seq_len

"""Rewards and advantages: the built-in checkers on answers written by hand (lm-eval's gsm8k
extraction rules, math-verify's equivalences), DAPO's over-length ramp, weights, a user's
function, and the refusals (a reward that raises, returns NaN or a non-number, a record without
the field a reward reads); advantages against the formulas computed by hand, and TRL's."""

import math
import sys
import types

import numpy as np
import pytest

from train.rl import advantages as adv_lib
from train.rl import rewards as rewards_lib


def _sample(completion, answer="72", *, tokens=5, max_tokens=10):
  return rewards_lib.Sample(prompt="q", completion=completion, record={"answer": answer},
                            where="data.train='p' record 3", num_tokens=tokens,
                            max_tokens=max_tokens)


@pytest.mark.parametrize("completion, strict, flexible", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", 1.0, 1.0),
    ("#### 72.", 1.0, 1.0),
    ("#### 1,072", 0.0, 0.0),
    ("The answer is 72", 0.0, 1.0),
    ("#### 71 but really 72", 0.0, 1.0),  # strict reads the first '#### N'; flexible the last
    ("72 #### 70", 0.0, 0.0),
    ("no number", 0.0, 0.0),
])
def test_gsm8k_strict_and_flexible(completion, strict, flexible):
  (s,), (f,) = (rewards_lib.parse_rewards(n) for n in ("gsm8k", "gsm8k_flexible"))
  answer = "Natalia sold 48/2 = 24 clips in May.\n#### 72"  # a GSM8K solution: N after ####
  assert s.function(_sample(completion, answer)) == strict
  assert f.function(_sample(completion, answer)) == flexible


def test_math_verify_accepts_equivalent_forms_and_rejects_others():
  pytest.importorskip("math_verify")
  (m,) = rewards_lib.parse_rewards("math")
  assert m.function(_sample(r"so the answer is $\frac{1}{2}$", "0.5")) == 1.0
  assert m.function(_sample(r"$\boxed{2x+2}$", "2(x+1)")) == 1.0
  assert m.function(_sample(r"$\boxed{3}$", "0.5")) == 0.0


def test_exact_format_overlong_and_weights():
  rewards = rewards_lib.parse_rewards("exact=2, format=0.5, overlong", format_pattern=r"^A:",
                                      overlong_buffer=4)
  total, values = rewards_lib.score(rewards, _sample(" 72 ", tokens=6))
  assert values == [1.0, 0.0, 0.0] and total == 2.0
  ramp = [rewards_lib.score(rewards, _sample("A: x", tokens=t))[1][2] for t in (6, 7, 8, 10)]
  assert ramp == [0.0, -0.25, -0.5, -1.0]
  total, _ = rewards_lib.score(rewards, _sample("A: x", tokens=8))
  assert total == pytest.approx(0.5 - 0.5)


def test_a_users_function_and_its_failures_are_named():
  module = types.ModuleType("my_rewards")
  module.length = lambda prompt, completion, record: len(completion) + len(record["answer"])
  module.boom = lambda prompt, completion, record: 1 / 0
  module.nan = lambda prompt, completion, record: math.nan
  module.text = lambda prompt, completion, record: "1"
  sys.modules["my_rewards"] = module
  try:
    (r,) = rewards_lib.parse_rewards("my_rewards:length")
    assert rewards_lib.score([r], _sample("abc"))[0] == 5.0
    for name, match in (("boom", "raised ZeroDivisionError: division by zero on data.train='p' "
                         "record 3"), ("nan", "returned nan on data.train='p' record 3"),
                        ("text", "returned '1' on")):
      (r,) = rewards_lib.parse_rewards(f"my_rewards:{name}")
      with pytest.raises(rewards_lib.RewardError, match=match):
        rewards_lib.score([r], _sample("abc"))
  finally:
    del sys.modules["my_rewards"]
  for spec, match in (("nope", "unknown reward 'nope'"), ("gsm8k=x", "is not NAME or NAME=WEIGHT"),
                      ("no_module_here:f", "nor an importable MODULE:FUNCTION")):
    with pytest.raises(rewards_lib.RewardError, match=match):
      rewards_lib.parse_rewards(spec)
  with pytest.raises(rewards_lib.RewardError, match="reads the field 'answer'.*record 1 has "
                     r"\['prompt', 'solution'\]"):
    rewards_lib.check_fields(rewards_lib.parse_rewards("format,gsm8k"),
                             [{"answer": 1}, {"prompt": "x", "solution": 2}], name="data.train")


def test_advantages_by_hand_and_as_trl_computes_them():
  r = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 0.0]])
  centred = r - r.mean(axis=1, keepdims=True)
  np.testing.assert_allclose(adv_lib.advantages(r, scale="none"), centred, rtol=1e-6)
  std = r.std(axis=1, ddof=1, keepdims=True)  # torch.std: Bessel-corrected, as TRL's nanstd
  np.testing.assert_allclose(adv_lib.advantages(r), centred / (std + 1e-4), rtol=1e-5)
  np.testing.assert_allclose(adv_lib.advantages(r, scale="batch"),
                             centred / (r.std(ddof=1) + 1e-4), rtol=1e-5)
  loo = np.stack([[r[g, k] - np.delete(r[g], k).mean() for k in range(4)] for g in range(3)])
  np.testing.assert_allclose(adv_lib.advantages(r, estimator="rloo", scale="none"), loo,
                             rtol=1e-6)
  assert not np.allclose(loo, centred)  # leave-one-out is not the plain baseline
  assert (adv_lib.advantages(r)[1] == 0).all()  # equal rewards: no signal
  torch = pytest.importorskip("torch")
  t = torch.tensor(r)
  want = (t - t.mean(1, keepdim=True)) / (t.std(1, keepdim=True) + 1e-4)
  np.testing.assert_allclose(adv_lib.advantages(r), want.numpy(), rtol=1e-5)


def test_the_docs_own_reward_runs(tmp_path):
  """docs/rl.md's "## Rewards: `--config.rl.rewards`" block, as written, is a reward that
  `rl.rewards` names; its value on a completion is the block's formula."""
  from support import doc_blocks
  text = doc_blocks.block("docs/rl.md", "## Rewards: `--config.rl.rewards`").text
  spec = text.splitlines()[0].split("--config.rl.rewards=")[1].strip('"')
  (tmp_path / "my_rewards.py").write_text(text)
  sys.path.insert(0, str(tmp_path))
  try:
    rewards = rewards_lib.parse_rewards(spec)
    total, values = rewards_lib.score(rewards, _sample("#### 72 and more"))
    assert [r.name for r in rewards] == ["gsm8k", "my_rewards:brevity"]
    assert values == [1.0, -len("#### 72 and more") / 1000]
    assert total == pytest.approx(1.0 - 0.1 * 16 / 1000)
  finally:
    sys.path.remove(str(tmp_path))
    sys.modules.pop("my_rewards", None)

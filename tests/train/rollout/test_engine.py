"""`train.rollout.engine.generate` against oracles written without it: the argmax of the
training forward pass, the full-forward decoder (`train.sample.reference`, every token a whole
forward of its row alone), `log_softmax` of the training logits, a chi-square test of the draws;
and the engine's own promises: one prefill per prompt for all its samples, lanes reused,
completions independent of the lanes and of the other prompts, stop strings cut exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from support.train_configs import synthetic_config
from train.model import decoder as model_lib
from train.rollout import cache as cache_lib
from train.rollout import engine
from train.rollout import sampling as sampling_lib
from train.sample import reference

VOCAB = 97


@pytest.fixture(scope="module")
def model():
  """A tiny random decoder whose output projection is scaled up, so that its next-token
  distributions are far from uniform (a draw from the wrong one shows)."""
  config = synthetic_config(**{"attention.implementation": "xla"})
  m = model_lib.build(config, 3, vocab_size=VOCAB)
  weight = m.embed.embedding if m.cfg.tie_embeddings else m.lm_head.kernel
  weight[...] = weight[...] * 6.0
  return m


@nnx.jit
def _call(model, input_ids, segment_ids, segment_positions):
  return model(input_ids, segment_ids=segment_ids, segment_positions=segment_positions)


def _training_logits(model, tokens):
  """Logits `[n, V]` of the model called as the trainer calls it, on the unpadded row."""
  ids_1xN = jnp.asarray([tokens], jnp.int32)
  return np.asarray(_call(model, ids_1xN, jnp.ones_like(ids_1xN),
                          jnp.arange(len(tokens), dtype=jnp.int32)[None])[0], np.float64)


def _log_softmax(x):
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [[1] + [int(t) for t in rng.integers(3, VOCAB, size=n - 1)] for n in lengths]


def _ids(completions):
  return [list(c.token_ids) for c in completions]


def test_greedy_is_the_argmax_of_the_training_logits(model):
  """An independent loop on the growing unpadded row, one training forward per token."""
  prompt = [1, 5, 6, 7]
  (got,) = engine.generate(model, [prompt], max_new_tokens=8)
  tokens, want = list(prompt), []
  for _ in range(8):
    want.append(int(np.argmax(_training_logits(model, tokens)[-1])))
    tokens.append(want[-1])
  assert list(got.token_ids) == want and got.finish_reason == "length"
  assert got.sampling_logprobs == (0.0,) * 8  # greedy: a point mass


@pytest.mark.parametrize("lanes", [None, 1, 2])
@pytest.mark.parametrize("drawn", [False, True])
def test_every_completion_equals_the_full_forward_decoder_alone(model, lanes, drawn):
  """Five prompts of different lengths on as many lanes as completions, on one lane (each
  completion after the other), or two: each equals the full-forward decoder on its prompt alone,
  token for token, greedy or drawn (temperature, top-k, top-p), with the same log-probs."""
  prompts = _prompts([4, 1, 13, 7, 30])
  sampling = (sampling_lib.Sampling(temperature=1.3, top_k=12, top_p=0.9) if drawn
              else sampling_lib.GREEDY)
  got = engine.generate(model, prompts, max_new_tokens=12, sampling=sampling, seed=7,
                        lanes=lanes)
  for i, (p, c) in enumerate(zip(prompts, got)):
    want, logprobs = reference.generate(model, p, max_new_tokens=12, sampling=sampling, seed=7,
                                        prompt_index=i)
    assert (c.prompt, c.sample) == (i, 0) and list(c.token_ids) == want and len(want) == 12
    np.testing.assert_allclose(c.logprobs, logprobs, atol=1e-5)


def test_n_greedy_samples_of_a_prompt_are_equal_and_share_one_prefill(model, monkeypatch):
  """8 greedy samples of one prompt: 8 equal completions, the prompt prefilled once into a
  cache of one prompt group (its slots stored once, not 8 times), 8 lanes."""
  calls, groups = [], []
  real_prefill, real_init = cache_lib.prefill, cache_lib.init_state

  def prefill(graphdef, params, state, ids_RxP, length_R, group_R):
    calls.append(int((np.asarray(group_R) < state["prompt_kv"].shape[2]).sum()))
    return real_prefill(graphdef, params, state, ids_RxP, length_R, group_R)

  def init_state(cfg, **shape):
    groups.append(shape)
    return real_init(cfg, **shape)

  monkeypatch.setattr(cache_lib, "prefill", prefill)
  monkeypatch.setattr(cache_lib, "init_state", init_state)
  got = engine.generate(model, [[1, 9, 8, 7]], num_samples=8, max_new_tokens=6)
  assert len({c.token_ids for c in got}) == 1 and [c.sample for c in got] == list(range(8))
  assert calls == [1]
  assert groups == [dict(groups=1, prompt_slots=16, lanes=8, new_slots=6)]


def test_a_completion_depends_on_seed_prompt_and_sample_only(model):
  """Drawn: the first two prompts' completions are the same with 3 lanes and 3 prompts or with
  16 lanes and another third prompt; the samples of one prompt differ; another seed differs."""
  sampling = sampling_lib.Sampling(temperature=1.0)
  prompts = _prompts([3, 9, 17], seed=1)
  a = engine.generate(model, prompts, num_samples=4, max_new_tokens=10, sampling=sampling,
                      seed=5, lanes=3)
  b = engine.generate(model, prompts[:2] + _prompts([5], seed=9), num_samples=4,
                      max_new_tokens=10, sampling=sampling, seed=5, lanes=16)
  assert _ids(a[:8]) == _ids(b[:8])
  assert len({c.token_ids for c in a[:4]}) > 1  # the samples are independent draws
  other = engine.generate(model, prompts, num_samples=4, max_new_tokens=10, sampling=sampling,
                          seed=6, lanes=3)
  assert _ids(other) != _ids(a)


def test_logprobs_are_the_training_log_softmax_and_renormalise_over_the_kept_tokens(model):
  """Temperature 1, no truncation: both log-probs are `log_softmax` of the training logits at the
  token's position (float32, 1e-5). Temperature 0.7 and top-p 0.8: `logprob` is log_softmax(l /
  0.7), `sampling_logprob` the same renormalised over the kept tokens (<= 0, and exactly the
  logprob less the log of the kept mass), and the draw is among the kept tokens."""
  prompt = _prompts([6], seed=4)[0]
  for sampling in (sampling_lib.Sampling(temperature=1.0),
                   sampling_lib.Sampling(temperature=0.7, top_p=0.8)):
    got = engine.generate(model, [prompt], num_samples=3, max_new_tokens=8, sampling=sampling,
                          seed=2)
    for c in got:
      tokens = list(prompt)
      for token, logp, logq in zip(c.token_ids, c.logprobs, c.sampling_logprobs):
        full = _log_softmax(_training_logits(model, tokens)[-1] / sampling.temperature)
        order = np.argsort(-full)
        kept = order[:int(np.searchsorted(np.cumsum(np.exp(full[order])), sampling.top_p)) + 1]
        assert token in kept
        np.testing.assert_allclose(logp, full[token], atol=1e-5)
        mass = np.exp(full[kept]).sum()
        np.testing.assert_allclose(logq, full[token] - np.log(mass), atol=1e-5)
        assert logq <= 0 and logq >= logp - 1e-6
        tokens.append(token)
    if sampling.top_p == 1:
      assert all(c.logprobs == pytest.approx(c.sampling_logprobs, abs=1e-6) for c in got)


def test_draws_follow_the_models_distribution_chi_square(model):
  """4,000 one-token completions of one prompt at temperature 1: their frequencies fit the
  model's softmax (chi-square, p > 1e-3); the same counts against the distribution at
  temperature 1.3 (the negative control) are rejected (p < 1e-6)."""
  prompt = [1, 4, 4, 20]
  got = engine.generate(model, [prompt], num_samples=4000, max_new_tokens=1, lanes=4000,
                        sampling=sampling_lib.Sampling(temperature=1.0), seed=11)
  counts = np.bincount([c.token_ids[0] for c in got], minlength=VOCAB)
  logits = _training_logits(model, prompt)[-1]

  def p_value(temperature):
    probs = np.exp(_log_softmax(logits / temperature))
    big = probs * len(got) >= 5  # the rare tokens pooled into one cell
    observed, expected = counts[big], probs[big] * len(got)
    if not big.all():
      observed = np.append(observed, counts[~big].sum())
      expected = np.append(expected, probs[~big].sum() * len(got))
    return stats.chisquare(observed, expected).pvalue

  assert p_value(1.0) > 1e-3
  assert p_value(1.3) < 1e-6


def _detokenize(ids):
  return "".join(f"<{i}>" for i in ids)


def test_a_stop_string_split_across_two_tokens_cuts_the_completion_exactly(model):
  """A stop string spanning tokens 3 and 4 of a greedy completion: the completion keeps tokens
  0..4 (the one that completed the string included), its text stops before the string, and
  another prompt's completion on the same lanes runs on."""
  prompts = _prompts([5, 8], seed=6)
  free = engine.generate(model, prompts, max_new_tokens=12)
  t = free[0].token_ids
  stop = f"{t[3]}><{t[4]}"  # the end of token 3's text and the start of token 4's
  assert stop not in _detokenize(t[:4]) and stop not in _detokenize(free[1].token_ids)
  got = engine.generate(model, prompts, max_new_tokens=12, stop_strings=[stop],
                        detokenize=_detokenize, steps_per_check=3)
  assert got[0].token_ids == t[:5] and got[0].finish_reason == "stop_string"
  assert got[0].stop == stop and got[0].logprobs == pytest.approx(free[0].logprobs[:5])
  text = _detokenize(t[:5])
  assert got[0].text == text[:text.index(stop)] and stop not in got[0].text
  assert got[1].token_ids == free[1].token_ids and got[1].finish_reason == "length"


def test_stops_at_a_stop_id_and_at_the_models_positions(model):
  prompts = _prompts([4, 4, 9], seed=2)
  greedy = _ids(engine.generate(model, prompts, max_new_tokens=8))
  stop = greedy[0][2]
  stopped = engine.generate(model, prompts, max_new_tokens=8, stop_ids=[stop], lanes=1)
  for got, full in zip(stopped, greedy):
    assert list(got.token_ids) == (full[:full.index(stop) + 1] if stop in full else full)
    assert got.finish_reason == ("stop" if stop in full else "length")
  assert stopped[0].stop == stop
  capped = engine.generate(model, prompts, max_new_tokens=50, max_len=12)
  assert [len(c.token_ids) for c in capped] == [8, 8, 3]  # prompt and new tokens fill 12
  assert [c.finish_reason for c in capped] == ["room"] * 3 and _ids(capped)[2] == greedy[2][:3]
  own = engine.generate(model, prompts, max_new_tokens=[2, 8, 5], lanes=2)  # one bound each
  assert _ids(own) == [greedy[0][:2], greedy[1], greedy[2][:5]]


def test_bad_prompts_and_settings_are_refused(model):
  for kwargs, match in (
      (dict(prompts=[[5], []]), "prompt 1 holds no token"),
      (dict(prompts=[[5, 97]]), r"prompt 0: .*\[0, 97\), got \[97\]"),
      (dict(prompts=[[5] * 12], max_len=12), "no room for a new one"),
      (dict(num_samples=0), "num_samples must be an int >= 1, got 0"),
      (dict(lanes=0), "lanes must be an int >= 1, got 0"),
      (dict(max_new_tokens=[4, 4]), "max_new_tokens: one per prompt, got 2 for 1 prompts"),
      (dict(max_new_tokens=[0]), r"max_new_tokens\[0\] must be an int >= 1, got 0"),
      (dict(stop_strings=[""], detokenize=_detokenize), "a stop string must be a non-empty"),
      (dict(stop_strings=["x"]), "stop strings need the tokenizer's decode")):
    kwargs = dict(dict(prompts=[[5]], max_new_tokens=4), **kwargs)
    with pytest.raises(sampling_lib.DecodeError, match=match):
      engine.generate(model, kwargs.pop("prompts"), **kwargs)
  for bad, match in ((dict(top_k=-1), "top_k must be an int >= 0, got -1"),
                     (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
                     (dict(temperature=-1.0), "temperature must be a number >= 0, got -1.0")):
    with pytest.raises(sampling_lib.DecodeError, match=match):
      sampling_lib.Sampling(**bad)


def test_the_smallest_top_p_draws_only_the_most_likely_token():
  logits_V = jnp.log(jnp.asarray([0.1, 0.3, 0.25, 0.2, 0.15]))
  for top_p in (float(np.finfo(np.float32).tiny), 1e-7, 0.29):
    sampling = sampling_lib.Sampling(temperature=1.0, top_p=top_p)
    drawn = {int(sampling_lib.choose(logits_V, jax.random.key(i), sampling)[0])
             for i in range(40)}
    assert drawn == {1}, (top_p, drawn)

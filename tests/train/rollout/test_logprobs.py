"""`train.rollout.logprobs.sequence_logprobs`, the trainer's per-token log-probs of (prompt,
completion) sequences on packed rows: equal to the sampler's recorded log-probs (the contract),
to `log_softmax` of each sequence's own unpacked training forward (the oracle), with the full and
the blocked loss, at the sampler's temperature."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support.train_configs import synthetic_config
from train.model import decoder as model_lib
from train.rollout import engine
from train.rollout import logprobs as logprobs_lib
from train.rollout import sampling as sampling_lib

VOCAB = 97


@pytest.fixture(scope="module")
def model():
  config = synthetic_config(**{"attention.implementation": "xla"})
  m = model_lib.build(config, 4, vocab_size=VOCAB)
  weight = m.embed.embedding if m.cfg.tie_embeddings else m.lm_head.kernel
  weight[...] = weight[...] * 4.0  # peaked distributions
  return m


@nnx.jit
def _call(model, ids_1xN):
  return model(ids_1xN, segment_ids=jnp.ones_like(ids_1xN),
               segment_positions=jnp.arange(ids_1xN.shape[1], dtype=jnp.int32)[None])


def _alone(model, prompt, completion, temperature):
  """The oracle: one unpadded row of this sequence alone, log_softmax in float64."""
  row = list(prompt) + list(completion)
  logits = np.asarray(_call(model, jnp.asarray([row], jnp.int32))[0], np.float64) / temperature
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return logp[np.arange(len(prompt) - 1, len(row) - 1), completion]


@pytest.mark.parametrize("block_size", [0, 8])
@pytest.mark.parametrize("sampling", [sampling_lib.Sampling(temperature=1.0),
                                      sampling_lib.Sampling(temperature=0.7, top_p=0.8)])
def test_packed_scoring_equals_the_samplers_logprobs_and_each_sequence_alone(model, sampling,
                                                                             block_size):
  rng = np.random.default_rng(0)
  prompts = [[1] + [int(t) for t in rng.integers(3, VOCAB, size=n)] for n in (2, 9, 5, 14)]
  done = engine.generate(model, prompts, num_samples=3, max_new_tokens=9, sampling=sampling,
                         seed=1, stop_ids=[7])
  sequences = [(prompts[c.prompt], c.token_ids) for c in done]
  got = logprobs_lib.sequence_logprobs(model, sequences, seq_len=64, batch_size=2,
                                       temperature=sampling.temperature, block_size=block_size)
  assert len(got) == len(done) and sum(len(p) + len(c) for p, c in sequences) > 64  # rows
  for c, (p, comp), scored in zip(done, sequences, got):
    assert scored.shape == (len(comp),)
    np.testing.assert_allclose(scored, c.logprobs, atol=1e-5)
    np.testing.assert_allclose(scored, _alone(model, p, comp, sampling.temperature), atol=1e-5)


def test_packing_changes_no_number_and_the_temperature_does(model):
  """The same sequences packed 64 slots to a row and one per row give the same log-probs; at
  another temperature they differ (the negative control)."""
  sequences = [([1, 5, 6], [8, 9, 10]), ([1, 40], [41]), ([1, 2, 3, 4], [50, 51, 52, 53])]
  packed = logprobs_lib.sequence_logprobs(model, sequences, seq_len=64)
  alone = [logprobs_lib.sequence_logprobs(model, [s], seq_len=len(s[0]) + len(s[1]))[0]
           for s in sequences]
  for a, b in zip(packed, alone):
    np.testing.assert_allclose(a, b, atol=1e-6)
  hot = logprobs_lib.sequence_logprobs(model, sequences, seq_len=64, temperature=2.0)
  assert not np.allclose(np.concatenate(hot), np.concatenate(packed), atol=1e-3)


def test_bad_sequences_are_refused(model):
  for sequences, kwargs, match in (
      ([([1, 2], [])], {}, "sequence 0: a prompt and a completion of at least one token"),
      ([([1], [2]), ([1] * 60, [2] * 5)], {}, "sequence 1 has 65 tokens: more than seq_len=64"),
      ([([1], [97])], {}, r"sequence 0: token ids must lie in \[0, 97\)"),
      ([([1], [2])], dict(temperature=0.0), "temperature must be a number > 0, got 0.0")):
    with pytest.raises(sampling_lib.DecodeError, match=match):
      logprobs_lib.sequence_logprobs(model, sequences, seq_len=64, **kwargs)

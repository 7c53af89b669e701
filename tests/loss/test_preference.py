"""`segpack.loss.preference` against the papers' formulas written here in NumPy (float64), and
per-segment sums against a loop over slots."""

import numpy as np
import pytest

from segpack.errors import ArgumentError
from segpack.loss import preference as pl


def _log_sigmoid(x):
  return -np.log1p(np.exp(-x))


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  n = 16
  return dict(chosen_logp=rng.uniform(-80, -5, n), rejected_logp=rng.uniform(-80, -5, n),
              chosen_tokens=rng.integers(1, 40, n).astype(float),
              rejected_tokens=rng.integers(1, 40, n).astype(float),
              ref_chosen_logp=rng.uniform(-80, -5, n), ref_rejected_logp=rng.uniform(-80, -5, n))


def _naive(loss, x, beta, eps, gamma):
  c, r, nc, nr = x["chosen_logp"], x["rejected_logp"], x["chosen_tokens"], x["rejected_tokens"]
  rc, rr = x["ref_chosen_logp"], x["ref_rejected_logp"]
  if loss == "dpo":  # Rafailov et al., conservative smoothing (Mitchell 2023)
    d = beta * ((c - rc) - (r - rr))
    return -(1 - eps) * _log_sigmoid(d) - eps * _log_sigmoid(-d)
  if loss == "ipo":  # Azar et al., per-token log-ratios as TRL
    return (((c - rc) / nc - (r - rr) / nr) - 1 / (2 * beta)) ** 2
  if loss == "simpo":  # Meng et al.
    return -_log_sigmoid(beta * (c / nc - r / nr) - gamma)
  pc, pr = np.exp(c / nc), np.exp(r / nr)  # ORPO, Hong et al.
  odds = np.log(pc / (1 - pc)) - np.log(pr / (1 - pr))
  return -c / nc - beta * _log_sigmoid(odds)


@pytest.mark.parametrize("loss", pl.LOSSES)
def test_losses_equal_the_papers_formulas(loss):
  x = _inputs()
  beta, eps, gamma = 0.3, 0.1 if loss == "dpo" else 0.0, 0.7
  got = pl.pair_losses(loss=loss, beta=beta, label_smoothing=eps, simpo_gamma=gamma,
                       **{k: np.float32(v) for k, v in x.items()})
  np.testing.assert_allclose(np.asarray(got["loss"]), _naive(loss, x, beta, eps, gamma),
                             rtol=2e-5, atol=1e-6)
  if loss in ("dpo", "ipo"):
    np.testing.assert_allclose(np.asarray(got["chosen_reward"]),
                               beta * (x["chosen_logp"] - x["ref_chosen_logp"]), rtol=1e-5)


def test_a_reference_loss_without_reference_scores_is_refused():
  x = _inputs()
  del x["ref_chosen_logp"], x["ref_rejected_logp"]
  with pytest.raises(ArgumentError, match="needs the reference's log-probs, got "
                                           "ref_chosen_logp=None and ref_rejected_logp=None"):
    pl.pair_losses(loss="dpo", **x)
  with pytest.raises(ValueError, match=r"got ref_rejected_logp=None$"):
    pl.pair_losses(loss="ipo", ref_chosen_logp=x["chosen_logp"], **x)
  with pytest.raises(ArgumentError, match=r"loss must be one of .*got 'kto'"):
    pl.check_loss("kto")


def test_pair_logps_sum_each_segment_over_its_trained_slots():
  rng = np.random.default_rng(1)
  segments = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 0, 0],
                       [1, 1, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0]])
  labels = rng.integers(0, 50, segments.shape)
  labels[rng.random(segments.shape) < 0.3] = -100
  logp = rng.uniform(-5, 0, segments.shape).astype(np.float32)
  chosen, rejected = np.array([[1, 3], [1, 0]]), np.array([[2, 4], [2, 0]])
  got = pl.pair_logps(logp, labels, segments, chosen, rejected)
  for b in range(2):
    for j in range(2):
      for name, seg in (("chosen", chosen), ("rejected", rejected)):
        inside = (segments[b] == seg[b, j]) & (labels[b] != -100) & (seg[b, j] > 0)
        assert float(got[f"{name}_logp"][b, j]) == pytest.approx(logp[b][inside].sum(), 1e-6)
        assert float(got[f"{name}_tokens"][b, j]) == inside.sum()

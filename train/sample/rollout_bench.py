"""The rollout engine's benchmark: the sections of `python -m train.sample --benchmark` that
measure what RL and evaluation ask of a sampler, side by side in one run on one model.

Sections (each a list of rows, printed as a table or as JSON):
  1. `shared`: `n` completions of each prompt from one prefill (`num_samples=n`) against the
     same prompts copied `n` times (`num_samples=1`): tokens/s and the KV cache's bytes.
  2. `lengths`: completions of equal lengths against long-tailed ones (a lognormal of the same
     mean, cut at 4x the mean as a `max_new_tokens` would; per-prompt bounds; the equal case's
     first completion is 4x the mean, so both caches have the same slots) on `lanes` lanes
     reused as they end, and the long-tailed
     ones in static batches of `lanes` (each batch waits for its longest: the negative
     control): tokens/s, and each case's against the equal case.
  3. `truncation`: the drawn distribution against the full one at top_p 0.8, 0.95 and 1.0: per
     drawn token, `ratio = exp(logprob - sampling_logprob)` (what a trainer that scores with the
     whole vocabulary sees against the sampler's own): median |delta log p| and the share of
     ratios outside [0.9, 1.1].
  4. `transformers`: the engine's `num_samples=n` against transformers' `generate` with
     `num_return_sequences=n`, `do_sample=True`, the same model exported to a Hugging Face
     directory (tokens/s; "not measured" without transformers and torch).
Tokens/s counts new tokens only; every case is compiled on a first call, then timed (best of
`repeats`). Seconds on a CPU say little about a GPU: the ratios are the figures to quote.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from train.rollout import engine
from train.rollout import sampling as sampling_lib

DRAW = sampling_lib.Sampling(temperature=1.0)


def best_of(fn: Any, repeats: int, *, warm: bool = True) -> tuple[float, Any]:
  """`(the fastest of `repeats` calls of fn in seconds, its result)`, after a first call that
  compiles (`warm`)."""
  if warm:
    fn()
  best, out = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - start)
  return best, out


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, vocab, size=int(rng.integers(16, 65)))]
          for _ in range(count)]


def _tokens(done: Sequence[engine.Completion]) -> int:
  return sum(len(c.token_ids) for c in done)


def shared(model: Any, *, prompts: int, n: int, new_tokens: int, repeats: int) -> list[dict]:
  """Section 1."""
  ps = _prompts(model.cfg.vocab_size, prompts, 1)
  rows = []
  for case, args in (("one prefill, num_samples=n", dict(prompts=ps, num_samples=n)),
                     ("prompts copied n times", dict(prompts=[p for p in ps for _ in range(n)],
                                                     num_samples=1))):
    seconds, done = best_of(lambda: engine.generate(model, args["prompts"], sampling=DRAW,
                                                  num_samples=args["num_samples"],
                                                  max_new_tokens=new_tokens), repeats)
    cache = engine.cache_bytes(model.cfg, args["prompts"], num_samples=args["num_samples"],
                               max_new_tokens=new_tokens)
    rows.append(dict(case=case, completions=len(done), tokens_per_s=_tokens(done) / seconds,
                     prompt_cache_mb=cache["prompt"] / 2**20,
                     lane_cache_mb=cache["lanes"] / 2**20))
  return rows


def lengths(model: Any, *, completions: int, lanes: int, mean: int, repeats: int) -> list[dict]:
  """Section 2."""
  ps = _prompts(model.cfg.vocab_size, completions, 2)
  rng = np.random.default_rng(3)
  draw = rng.lognormal(0, 0.75, completions)
  tail = np.clip(np.round(draw / draw.mean() * mean), 1, 4 * mean).astype(int).tolist()
  # The equal case's first completion has the cap's length, so its cache is the long-tailed
  # case's (a lane's slots are the longest room, as a run's max_new_tokens sizes them).
  cases = (("equal lengths, lanes reused", [4 * mean] + [mean] * (completions - 1), lanes),
           ("long-tailed, lanes reused", tail, lanes),
           ("long-tailed, static batches", tail, None))
  rows = []
  for case, bounds, reuse in cases:
    steps = []

    def run(bounds=bounds, reuse=reuse, steps=steps):
      steps.clear()
      calls = ([(ps, bounds)] if reuse else  # static: one call per batch, no lane reused
               [(ps[at:at + lanes], bounds[at:at + lanes]) for at in range(0, completions, lanes)])
      out = []
      for prompts, bound in calls:
        stats = {}
        out += engine.generate(model, prompts, max_new_tokens=bound, sampling=DRAW, lanes=lanes,
                               stats=stats)
        steps.append(stats["decode_steps"])
      return out

    seconds, done = best_of(run, repeats)
    decoded = _tokens(done) - len(done)  # each first token comes from its prompt's prefill
    rows.append(dict(case=case, completions=completions, lanes=lanes,
                     longest=max(bounds), tokens=_tokens(done), decode_steps=sum(steps),
                     lane_use=decoded / (sum(steps) * lanes),
                     tokens_per_s=_tokens(done) / seconds))
  for row in rows:
    row["vs_equal"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
  return rows


def truncation(model: Any, *, prompts: int, new_tokens: int) -> list[dict]:
  """Section 3."""
  ps = _prompts(model.cfg.vocab_size, prompts, 4)
  rows = []
  for top_p in (0.8, 0.95, 1.0):
    done = engine.generate(model, ps, num_samples=4, max_new_tokens=new_tokens, seed=5,
                           sampling=sampling_lib.Sampling(temperature=1.0, top_p=top_p))
    delta = np.concatenate([np.subtract(c.logprobs, c.sampling_logprobs) for c in done])
    ratio = np.exp(delta)
    rows.append(dict(top_p=top_p, tokens=len(delta), median_abs_delta_logp=float(
        np.median(np.abs(delta))), mean_ratio=float(ratio.mean()),
        share_outside_0_9_1_1=float(np.mean((ratio < 0.9) | (ratio > 1.1)))))
  return rows


def _hf_generate(model_dir: str, prompts: list[list[int]], *, n: int, new_tokens: int) -> int:
  import torch  # optional: the transformers section only
  import transformers  # optional: the transformers section only
  hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  total = 0
  with torch.no_grad():
    for p in prompts:
      out = hf.generate(input_ids=torch.tensor([p]), do_sample=True, num_return_sequences=n,
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens, top_k=0,
                        top_p=1.0, temperature=1.0, pad_token_id=0)
      total += int(out[:, len(p):].numel())
  return total


def versus_transformers(model: Any, *, model_dir: str | None, prompts: int, n: int,
                        new_tokens: int, repeats: int) -> list[dict]:
  """Section 4 (`model_dir`: the model as a Hugging Face directory; None: not measured)."""
  ps = _prompts(model.cfg.vocab_size, prompts, 6)
  seconds, done = best_of(lambda: engine.generate(model, ps, num_samples=n, sampling=DRAW,
                                                max_new_tokens=new_tokens), repeats)
  rows = [dict(case=f"segpack engine, num_samples={n}", tokens_per_s=_tokens(done) / seconds)]
  name = f"transformers generate, num_return_sequences={n}"
  if model_dir is None:
    rows.append(dict(case=name, tokens_per_s=None,
                     note="not measured: transformers and torch are not installed"))
    return rows
  seconds, tokens = best_of(lambda: _hf_generate(model_dir, ps, n=n, new_tokens=new_tokens), 1)
  rows.append(dict(case=name, tokens_per_s=tokens / seconds))
  rows[0]["vs_transformers"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
  return rows


def hf_model(directory: str, *, vocab: int, layers: int = 4, width: int = 256) -> str | None:
  """A random Llama written by transformers (`save_pretrained`) into `directory`, the model
  every section runs on once imported; None without transformers and torch."""
  try:
    import torch  # optional: the transformers section only
    import transformers  # optional: the transformers section only
  except ImportError:
    return None
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=width, intermediate_size=width * 11 // 4,
      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
      max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="float32")
  transformers.LlamaForCausalLM(config).save_pretrained(directory)
  return directory


def _cell(value: Any) -> str:
  if value is None:
    return "not measured"
  if isinstance(value, float):
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
  return str(value)


def section_table(name: str, rows: Sequence[dict]) -> str:
  """One section's rows as a fixed-width table (every key a column, in first-seen order)."""
  keys = list(dict.fromkeys(k for r in rows for k in r))
  cells = [[_cell(r.get(k, "")) for k in keys] for r in rows]
  widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
  head = "  ".join(k.rjust(w) for k, w in zip(keys, widths))
  lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
  return "\n".join([f"[{name}]", head, "-" * len(head), *lines])


def run(model: Any, *, model_dir: str | None, quick: bool, repeats: int) -> dict[str, list]:
  """Every section on `model` (the long-tailed case's lanes, the sizes shrunk by `quick`)."""
  scale = 4 if quick else 1
  return dict(
      shared=shared(model, prompts=8 // scale, n=8, new_tokens=64 // scale, repeats=repeats),
      lengths=lengths(model, completions=256 // scale, lanes=16 // scale, mean=32 // scale,
                      repeats=repeats),
      truncation=truncation(model, prompts=8 // scale, new_tokens=32 // scale),
      transformers=versus_transformers(model, model_dir=model_dir, prompts=4 // scale, n=8,
                                       new_tokens=32 // scale, repeats=repeats))

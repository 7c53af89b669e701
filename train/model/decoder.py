"""A Llama-like decoder-only transformer in Flax NNX that runs on packed, segment-annotated rows.

Pieces: token embedding, `L` blocks of (RMSNorm -> grouped-query attention with rotary position
embeddings -> residual, RMSNorm -> SwiGLU feed-forward -> residual), a final RMSNorm and an output
projection (optionally tied to the embedding). Attention goes through
`segpack.attention.segment_attention`, and the rotary angles come from `segment_positions`, so
every document of a packed row sees exactly what it would see alone.

Context parallelism: with a `context` axis of several devices every row's slots are split over
it (context order, `slot_index`: `train.context_batches`); attention runs under `shard_map` with
`context_axis="context"`. On a mesh of explicit axes every projection, the lookup and the logits
name their shardings (`train.model.layout`). Projections may carry LoRA adapters over a frozen,
perhaps quantized, base (`model.lora`, `train.model.lora`). The configuration (`DecoderConfig`)
and its checks are `train.model.config`'s.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from segpack import attention as attention_lib
from segpack.errors import ArgumentError
from segpack.mesh import BATCH_AXES, CONTEXT_AXIS, TENSOR_AXIS
from train.model.config import DTYPES, DecoderConfig, attention_mesh, cudnn_bound, decoder_config
from train.model import layout as layout_lib
from train.model import lora as lora_lib
from train.model import rope as rope_lib

# `model.remat` (configs.architecture.REMATS but "none"): the policy each decoder layer runs under.
REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class RMSNorm(nnx.Module):
  """Root-mean-square layer norm with a learned scale; statistics in float32."""

  def __init__(self, dim: int, *, eps: float, dtype: Any, param_dtype: Any):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x_BxSxE: jax.Array) -> jax.Array:
    x = x_BxSxE.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def _linear(d_in: int, d_out: int, cfg: DecoderConfig, rngs: nnx.Rngs, *, name: str, std: float,
            bias: bool = False) -> nnx.Linear:
  return lora_lib.linear(d_in, d_out, name=name, lora=cfg.lora, bias=bias, dtype=DTYPES[cfg.dtype],
                         param_dtype=DTYPES[cfg.param_dtype], std=std, rngs=rngs)


def _stored(cfg: DecoderConfig) -> Any:
  """The storage dtype of the weights besides the projections (frozen ones under adapters)."""
  return lora_lib.frozen_dtype(cfg.lora, DTYPES[cfg.param_dtype])


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, restricted to each token's own segment."""

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
    qkv = dict(std=cfg.init_std, bias=cfg.qkv_bias)
    self.q = _linear(cfg.d_model, cfg.num_heads * cfg.head_dim, cfg, rngs, name="q", **qkv)
    self.k = _linear(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, cfg, rngs, name="k", **qkv)
    self.v = _linear(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, cfg, rngs, name="v", **qkv)
    self.o = _linear(cfg.num_heads * cfg.head_dim, cfg.d_model, cfg, rngs, name="o", std=out_std)
    if cfg.qk_norm:
      norm = dict(eps=cfg.norm_eps, dtype=DTYPES[cfg.dtype], param_dtype=_stored(cfg))
      self.q_norm = RMSNorm(cfg.head_dim, **norm)
      self.k_norm = RMSNorm(cfg.head_dim, **norm)
    self.cfg = cfg

  def qkv(self, x_BxSxE: jax.Array, angles_BxSxD2: jax.Array
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries `[B, S, H, D]`, keys and values `[B, S, K, D]`, normed (Qwen3) and rotated: what
    attention reads (and what a decoder's KV cache keeps)."""
    cfg = self.cfg
    b, s, _ = x_BxSxE.shape
    layout = layout_lib.layout_of(x_BxSxE)
    heads = self.head_split(layout)
    q_BxSxHxD = lora_lib.dense(self.q, x_BxSxE, layout, split_out=heads).reshape(
        b, s, cfg.num_heads, cfg.head_dim)
    k_BxSxKxD = lora_lib.dense(self.k, x_BxSxE, layout, split_out=heads).reshape(
        b, s, cfg.num_kv_heads, cfg.head_dim)
    v_BxSxKxD = lora_lib.dense(self.v, x_BxSxE, layout, split_out=heads).reshape(
        b, s, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q_BxSxHxD, k_BxSxKxD = self.q_norm(q_BxSxHxD), self.k_norm(k_BxSxKxD)
    return (rope_lib.apply_rope(q_BxSxHxD, angles_BxSxD2), rope_lib.apply_rope(k_BxSxKxD, angles_BxSxD2),
            v_BxSxKxD)

  def head_split(self, layout: layout_lib.Layout | None) -> str | None:
    """The mesh axis that splits the heads on an explicit mesh: `tensor` when K (and so H)
    divides by it, else None (every device computes every head)."""
    return None if layout is None else layout.split(self.cfg.num_kv_heads)

  def __call__(self, x_BxSxE: jax.Array, angles_BxSxD2: jax.Array,
               segment_ids_BxS: jax.Array, slot_index_BxS: jax.Array | None = None,
               prefix_segment_ids_BxS: jax.Array | None = None) -> jax.Array:
    cfg = self.cfg
    b, s, _ = x_BxSxE.shape
    layout = layout_lib.layout_of(x_BxSxE)
    heads = self.head_split(layout)
    q_BxSxHxD, k_BxSxKxD, v_BxSxKxD = self.qkv(x_BxSxE, angles_BxSxD2)
    impl, mesh = cfg.attention_implementation, attention_mesh(cfg)
    extra = dict(context_axis=CONTEXT_AXIS) if layout_lib.context_size(mesh) > 1 else {}
    if slot_index_BxS is not None:
      extra["slot_index"] = slot_index_BxS
    if prefix_segment_ids_BxS is not None:  # shared prompts: branches see theirs
      extra["prefix_segment_ids"] = prefix_segment_ids_BxS
    out_BxSxHxD = attention_lib.segment_attention(
        q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, causal=True, implementation=impl,
        mesh=mesh, batch_axis=BATCH_AXES, head_axis=TENSOR_AXIS if layout is None else heads,
        pallas=cfg.attention_pallas, cudnn_segment_bound=cfg.attention_cudnn_segment_bound,
        **extra)
    if layout is not None:  # as the o projection's row split reads it
      out_BxSxHxD = layout.put(out_BxSxHxD, layout.rows, layout.slots, heads, None)
    return lora_lib.dense(self.o, out_BxSxHxD.reshape(b, s, cfg.num_heads * cfg.head_dim),
                            layout, split_in=heads)


class SwiGLU(nnx.Module):
  """Feed-forward `down(silu(gate(x)) * up(x))`."""

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
    self.gate = _linear(cfg.d_model, cfg.d_ff, cfg, rngs, name="gate", std=cfg.init_std)
    self.up = _linear(cfg.d_model, cfg.d_ff, cfg, rngs, name="up", std=cfg.init_std)
    self.down = _linear(cfg.d_ff, cfg.d_model, cfg, rngs, name="down", std=out_std)

  def __call__(self, x_BxSxE: jax.Array) -> jax.Array:
    layout = layout_lib.layout_of(x_BxSxE)
    ff = None if layout is None else layout.split(self.down.in_features)
    h_BxSxF = (jax.nn.silu(lora_lib.dense(self.gate, x_BxSxE, layout, split_out=ff))
               * lora_lib.dense(self.up, x_BxSxE, layout, split_out=ff))
    return lora_lib.dense(self.down, h_BxSxF, layout, split_in=ff)


class Block(nnx.Module):
  """Pre-norm transformer block: attention and SwiGLU, each with a residual connection."""

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    norm = dict(eps=cfg.norm_eps, dtype=DTYPES[cfg.dtype], param_dtype=_stored(cfg))
    self.attn_norm = RMSNorm(cfg.d_model, **norm)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, **norm)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x_BxSxE, angles_BxSxD2, segment_ids_BxS, slot_index_BxS=None,
               prefix_segment_ids_BxS=None):
    x_BxSxE = x_BxSxE + self.attn(self.attn_norm(x_BxSxE), angles_BxSxD2, segment_ids_BxS,
                                  slot_index_BxS, prefix_segment_ids_BxS)
    return x_BxSxE + self.mlp(self.mlp_norm(x_BxSxE))


class Decoder(nnx.Module):
  """Decoder-only language model over packed rows.

  Algorithm:
    1. Embed `input_ids` (`[B, S]` -> `[B, S, E]`).
    2. Compute rotary angles from `segment_positions`, which restart at 0 in every segment, so a
       document's positions do not depend on where it was packed.
    3. Run `L` pre-norm blocks; attention only lets a token see earlier tokens of its own segment
       (`segment_ids`, 0 = padding, which attends to nothing).
    4. Final RMSNorm, then project to `V` logits (float32).

  Example: a row `[a b c | d e | pad]` has `segment_ids = [1 1 1 2 2 0]` and `segment_positions =
  [0 1 2 0 1 0]`; the logits at `d e` equal those of the row `[d e]` alone.
  """

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(
        cfg.vocab_size, cfg.d_model, dtype=DTYPES[cfg.dtype],
        param_dtype=_stored(cfg),
        embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=DTYPES[cfg.dtype],
                              param_dtype=_stored(cfg))
    if not cfg.tie_embeddings:
      self.lm_head = _linear(cfg.d_model, cfg.vocab_size, cfg, rngs, name="lm_head",
                             std=cfg.init_std)

  def embed_tokens(self, input_ids_BxS: jax.Array) -> jax.Array:
    """The token embeddings `[B, S, E]` (exposed so tests can differentiate w.r.t. them).

    On a mesh with explicit axes (what `jax.make_mesh` makes by default) the lookup reads the
    table gathered whole and names its output sharding, the ids' own (rows and slots as the
    batch is split, E whole; `train.model.layout.lookup`): JAX refuses a gather whose output sharding
    it would have to guess."""
    layout = layout_lib.layout_of(input_ids_BxS)
    if layout is None:
      return self.embed(input_ids_BxS)
    return layout_lib.lookup(self.embed, input_ids_BxS, layout, DTYPES[self.cfg.dtype])

  def from_embeddings(self, x_BxSxE: jax.Array, *, segment_ids: jax.Array,
                      segment_positions: jax.Array, slot_index: jax.Array | None = None,
                      prefix_segment_ids: jax.Array | None = None,
                      logits: bool = True) -> jax.Array:
    """Runs the blocks and the head on given embeddings; returns float32 logits `[B, S, V]`
    (on an explicit mesh split as the embeddings' rows and slots, the vocabulary whole), or
    with `logits=False` the final hidden states `[B, S, E]` (after the final norm: what the
    output projection, `head_weight`, reads). Each block runs under `cfg.remat`'s policy."""
    angles_BxSxD2 = rope_lib.rope_angles(segment_positions, head_dim=self.cfg.head_dim,
                                theta=self.cfg.rope_theta, scaling=self.cfg.rope_scaling)
    run = Block.__call__
    if self.cfg.remat != "none":
      run = nnx.remat(run, policy=REMAT_POLICIES[self.cfg.remat])
    for block in self.layers:
      x_BxSxE = run(block, x_BxSxE, angles_BxSxD2, segment_ids, slot_index, prefix_segment_ids)
    return self.head(x_BxSxE) if logits else self.final_norm(x_BxSxE)

  def head_weight(self) -> tuple[jax.Array, bool]:
    """`(the output projection in the compute dtype, tied)`: the embedding table `[V, E]` when
    tied (`logits = hidden @ table.T`), else `lm_head`'s kernel `[E, V]`."""
    weight = (self.embed.embedding if self.cfg.tie_embeddings else self.lm_head.kernel)[...]
    return weight.astype(DTYPES[self.cfg.dtype]), self.cfg.tie_embeddings

  def head(self, x_BxSxE: jax.Array) -> jax.Array:
    """The last block's output to float32 logits `[B, S, V]`: final RMSNorm, then the output
    projection (the embedding's transpose when tied)."""
    x_BxSxE = self.final_norm(x_BxSxE)
    layout = layout_lib.layout_of(x_BxSxE)
    if layout is None:
      logits_BxSxV = (self.embed.attend(x_BxSxE) if self.cfg.tie_embeddings
                      else self.lm_head(x_BxSxE))
      return logits_BxSxV.astype(jnp.float32)
    if self.cfg.tie_embeddings:
      logits_BxSxV = layout_lib.attend(self.embed, x_BxSxE, layout)
    else:
      logits_BxSxV = lora_lib.dense(self.lm_head, x_BxSxE, layout,
                                      split_out=layout.split(self.cfg.vocab_size))
    logits_BxSxV = layout.put(logits_BxSxV, layout.rows, layout.slots, None)
    return logits_BxSxV.astype(jnp.float32)

  def __call__(self, input_ids: jax.Array, *, segment_ids: jax.Array,
               segment_positions: jax.Array, slot_index: jax.Array | None = None,
               prefix_segment_ids: jax.Array | None = None, logits: bool = True) -> jax.Array:
    """Returns float32 logits `[B, S, V]` for int `[B, S]` ids, segment ids and positions
    (`logits=False`: the final hidden states `[B, S, E]`, `from_embeddings`);
    `prefix_segment_ids`: each slot's shared prompt segment (pair rows, `segment_attention`).

    `slot_index`: for a row in context order (`train.context_batches`), each slot's index in the row
    before reordering (attention's causal order); None: the slots are in row order. Inputs
    typed with no mesh, given to a decoder whose attention runs on a mesh of explicit axes
    (`attention_mesh`) or whose parameters are placed on one, are put on it split as the
    trainer's batches (`train.model.layout.on_mesh`).
    """
    named = dict(input_ids=input_ids, segment_ids=segment_ids, segment_positions=segment_positions,
                 slot_index=slot_index, prefix_segment_ids=prefix_segment_ids)
    shapes = {name: tuple(x.shape) for name, x in named.items() if x is not None}
    if len(set(shapes.values())) > 1:
      raise ArgumentError(
          "Decoder: " + ", ".join(f"{name} {shape}" for name, shape in shapes.items())
          + " must have one [B, S] shape")
    mesh = attention_mesh(self.cfg) or layout_lib.mesh_of(self.embed.embedding[...])
    named = {k: layout_lib.on_mesh(mesh, x) for k, x in named.items()}
    return self.from_embeddings(self.embed_tokens(named.pop("input_ids")), **named,
                                logits=logits)

  def batch_logits(self, batch: dict[str, jax.Array], *, logits: bool = True) -> jax.Array:
    """Logits `[B, S, V]` of a trainer batch: its `input_ids`, `segment_ids`,
    `segment_positions` and, for a batch in context order, `slot_index` (`logits=False`: the
    final hidden states `[B, S, E]`)."""
    return self(batch["input_ids"], segment_ids=batch["segment_ids"],
                segment_positions=batch["segment_positions"], slot_index=batch.get("slot_index"),
                prefix_segment_ids=batch.get("prefix_segment_ids"), logits=logits)


def build(config: Any, seed: int, *, vocab_size: int | None = None, mesh: Any = None,
          segment_bound: int | None = None) -> Decoder:
  """Builds the `Decoder` that a trainer config (its `model` and `attention` groups) describes.

  Args:
    config: a trainer config (`configs/packed.py`) or any object with `model` and `attention`.
    seed: parameter initialisation seed.
    vocab_size: overrides `config.model.vocab_size` (the trainer passes the tokenizer's size).
    mesh: the trainer's mesh (axes `segpack.mesh.MESH_AXES`); kernel attention backends run
      per device under `shard_map` on it.
    segment_bound: the data's most segments in a row (`train.data.Data.segment_bound`);
      with `attention.implementation="cudnn"` it is required and becomes, rounded up to a power
      of two (`cudnn_bound`), the cuDNN backend's static bound N.
  """
  vocab = vocab_size if vocab_size is not None else config.model.vocab_size
  cfg = decoder_config(config.model, config.attention, vocab_size=int(vocab), mesh=mesh,
                       cudnn_segment_bound=cudnn_bound(config, segment_bound))
  return Decoder(cfg, rngs=nnx.Rngs(params=seed))


def abstract(config: Any, *, vocab_size: int | None = None, mesh: Any = None,
             segment_bound: int | None = None) -> Decoder:
  """`build`'s decoder as shapes only (`nnx.eval_shape`: nothing is initialised), the one
  place a run, an import, an export or a benchmark gets the model's abstract shapes."""
  return nnx.eval_shape(lambda: build(config, 0, vocab_size=vocab_size, mesh=mesh,
                                      segment_bound=segment_bound))

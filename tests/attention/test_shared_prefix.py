"""segment_attention(prefix_segment_ids=...): shared prompts of preference pairs, XLA and Pallas.

Forward and dq/dk/dv against the float64 oracle of tests/support/prefix_attention_oracle.py
(its mask written out with loops from the rule), a branch against its prompt + branch run as one
ordinary segment (and, without the prefix ids, the negative control), the block ranges against
brute force, the checked mode's refusals, the cuda lowering and a mesh.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from segpack.attention import (AttentionInputError, AttentionTypeError,
                               NonContiguousSegmentsError, PallasOptions, segment_attention)
from segpack.attention import blocks
from segpack.attention.pallas import segment_attention_pallas
from support.attention_inputs import random_inputs
from support.prefix_attention_oracle import pair_rows, prefix_mask, prefix_reference

# The worked example of the docs: prompt 1 with branches 2 and 3, prompt 4 with branch 5.
EXAMPLE_SEG = [1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 0, 0]
EXAMPLE_PRE = [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 4, 4, 0, 0]


def _pallas_options(bq, bk, bq_bwd, bk_bwd):
  return PallasOptions(block_q=bq, block_k=bk, block_q_bwd=bq_bwd, block_k_bwd=bk_bwd,
                       interpret=True)


def _fwd_bwd(seg, pre, q, k, v, dout, *, causal, **kw):
  def f(q, k, v):
    return segment_attention(q, k, v, seg, prefix_segment_ids=pre, causal=causal, **kw)
  out, vjp = jax.vjp(f, q, k, v)
  return out, vjp(dout)


def _assert_matches(out, grads, want, grads_want, *, gtol=1e-4):
  np.testing.assert_allclose(out, want, atol=2e-5)
  for name, got, ref in zip("qkv", grads, grads_want):
    np.testing.assert_allclose(got, ref, atol=gtol, err_msg=f"d{name}")


def test_oracle_mask_is_the_rule_on_the_worked_example():
  mask = prefix_mask(np.array(EXAMPLE_SEG), np.array(EXAMPLE_PRE), causal=True)
  assert mask[4].nonzero()[0].tolist() == [0, 1, 2, 3, 4]  # chosen: prompt + itself
  assert mask[7].nonzero()[0].tolist() == [0, 1, 2, 5, 6, 7]  # rejected: never the chosen
  assert mask[2].nonzero()[0].tolist() == [0, 1, 2]  # the prompt: itself only
  assert mask[11].nonzero()[0].tolist() == [8, 9, 10, 11]
  assert not mask[12:].any()


@pytest.mark.parametrize("causal", [True, False])
def test_xla_matches_oracle_forward_and_grads(causal):
  """Random pair rows (prompts and branches of 1 to 47 slots, ids unordered), GQA 4/2."""
  seg, pre = pair_rows(np.random.default_rng(1 + causal), 3, 96)
  q, k, v, dout = random_inputs(2, 3, 96, 4, 2, 16)
  out, grads = jax.jit(lambda *a: _fwd_bwd(seg, pre, *a, causal=causal, implementation="xla"))(
      q, k, v, dout)
  want, grads_want = prefix_reference(q, k, v, seg, pre, causal=causal, dout=dout)
  _assert_matches(out, grads, want, grads_want)
  assert np.all(np.asarray(out)[seg == 0] == 0)


@pytest.mark.parametrize("causal,blocks_", [(True, (16, 32, 32, 16)), (False, (32, 16, 16, 32))])
def test_pallas_matches_oracle_forward_and_grads(causal, blocks_):
  """Interpret mode, uneven forward and backward blocks, S = 120 (padded to 128), GQA 4/2."""
  seg, pre = pair_rows(np.random.default_rng(5 + causal), 2, 120)
  q, k, v, dout = random_inputs(3, 2, 120, 4, 2, 16)
  fn = lambda *a: _fwd_bwd(seg, pre, *a, causal=causal, implementation="pallas",
                           pallas=_pallas_options(*blocks_))
  out, grads = jax.jit(fn)(q, k, v, dout)
  want, grads_want = prefix_reference(q, k, v, seg, pre, causal=causal, dout=dout)
  _assert_matches(out, grads, want, grads_want)
  assert np.all(np.asarray(out)[seg == 0] == 0) and np.all(np.asarray(grads[0])[seg == 0] == 0)


def _pair_row(s=128):
  """One row: padding, prompt P (45), chosen C (20), rejected R (33), padding, prompt Q (7) and
  its one branch B (15), a padding tail; and the slots of each branch's `[prompt + branch]`."""
  seg, pre = np.zeros((1, s), np.int32), np.zeros((1, s), np.int32)
  spans = {}
  pos = 3
  for name, sid, size, prompt in (("P", 7, 45, 0), ("C", 3, 20, 7), ("R", 9, 33, 7),
                                  ("pad", 0, 3, 0), ("Q", 2, 7, 0), ("B", 5, 15, 2)):
    seg[0, pos:pos + size], pre[0, pos:pos + size] = sid, prompt
    spans[name] = np.arange(pos, pos + size)
    pos += size
  runs = {b: np.concatenate([spans[p], spans[b]]) for p, b in (("P", "C"), ("P", "R"), ("Q", "B"))}
  return seg, pre, spans, runs


def _as_one_segment(x_BxSxNxD, slots, s):
  """The slots of `slots`, in order, at the head of a row of `s` slots (zeros after)."""
  out = np.zeros_like(np.asarray(x_BxSxNxD))
  out[:, :len(slots)] = np.asarray(x_BxSxNxD)[:, slots]
  return jnp.asarray(out)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_branch_equals_its_prompt_and_branch_run_as_one_segment(implementation):
  """A branch's output is that of attention over `[prompt + branch]` as one ordinary segment
  (XLA, no prefix ids); without the prefix ids (the negative control) it is not."""
  s = 128
  seg, pre, spans, runs = _pair_row(s)
  q, k, v, _ = random_inputs(7, 1, s, 4, 2, 16)
  kw = dict(pallas=_pallas_options(32, 16, 16, 32)) if implementation == "pallas" else {}
  out = segment_attention(q, k, v, jnp.asarray(seg), prefix_segment_ids=jnp.asarray(pre),
                          implementation=implementation, **kw)
  plain = segment_attention(q, k, v, jnp.asarray(seg), implementation="xla")
  for branch, slots in runs.items():
    one = np.zeros((1, s), np.int32)
    one[0, :len(slots)] = 1
    cat = segment_attention(*(_as_one_segment(x, slots, s) for x in (q, k, v)),
                            jnp.asarray(one), implementation="xla")
    n = len(spans[branch])
    want = np.asarray(cat)[0, len(slots) - n:len(slots)]
    np.testing.assert_allclose(np.asarray(out)[0, spans[branch]], want, atol=2e-5,
                               err_msg=branch)
    gap = np.abs(np.asarray(plain)[0, spans[branch]] - want).max()
    assert gap > 0.05, (branch, gap)  # without the prefix ids the branch misses its prompt
  for prompt in ("P", "Q"):  # prompts see themselves only, with or without the prefix ids
    np.testing.assert_allclose(np.asarray(out)[0, spans[prompt]],
                               np.asarray(plain)[0, spans[prompt]], atol=2e-5)


def _tiles(seg_row, pre_row, bq, bk, causal):
  s = len(seg_row)
  tiles = prefix_mask(seg_row, pre_row, causal=causal).reshape(s // bq, bq, s // bk, bk)
  return tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))


@pytest.mark.parametrize("bq,bk,causal", [(16, 16, True), (16, 32, True), (32, 16, True),
                                          (32, 16, False)])
def test_block_ranges_cover_the_prefixes_and_mask_free_tiles_need_no_mask(causal, bq, bk):
  """Every needed tile is visited, both range ends are needed, mask-free tiles are all visible;
  an all-zero prefix gives the ranges without one."""
  seg, pre = pair_rows(np.random.default_rng(bq + 3 * bk + causal), 12, 128)
  # and a row whose chosen branch holds whole query blocks right after its prompt
  seg = np.concatenate([seg, [np.repeat([1, 2, 3], [48, 48, 32])]]).astype(np.int32)
  pre = np.concatenate([pre, [np.repeat([0, 1, 1], [48, 48, 32])]]).astype(np.int32)
  args = dict(block_q=bq, block_k=bk, causal=causal)

  def all_ranges(seg, pre):  # (query, key) ranges: with the prefix, with zeros, without
    fns = (blocks.q_block_ranges, blocks.kv_block_ranges)
    return [[fn(seg, prefix_ids_BxS=p, **args) for fn in fns]
            for p in (pre, jnp.zeros_like(pre), None)]
  (qr, kr), zero, plain = jax.tree.map(np.asarray, jax.jit(all_ranges)(seg, pre))
  prompt_tiles = [0, 0]  # mask-free tiles pairing a branch's queries with its prompt's keys
  for r in range(len(seg)):
    needed, unmasked = _tiles(seg[r], pre[r], bq, bk, causal)
    for ranges, need, full in ((qr[r], needed, unmasked), (kr[r], needed.T, unmasked.T)):
      for i, (lo, hi, flo, fhi) in enumerate(ranges):
        cols = np.flatnonzero(need[i])
        if len(cols) == 0:
          assert lo == hi
          continue
        assert lo == cols[0] and hi == cols[-1] + 1, (r, i, lo, hi, cols)
        assert lo <= flo <= fhi <= hi and (fhi > flo or flo == hi)
        assert np.all(full[i, flo:fhi]), (r, i, flo, fhi)
    for side, (ranges, b_own, b_other) in enumerate(((qr[r], bq, bk), (kr[r], bk, bq))):
      for i, (_, _, flo, fhi) in enumerate(ranges):
        own = seg[r, i * b_own]
        prompt_tiles[side] += sum(np.any(seg[r, j * b_other:(j + 1) * b_other] != own)
                                  for j in range(flo, fhi))
  assert min(prompt_tiles) > 0, prompt_tiles
  for got, want in zip(zero, plain):
    np.testing.assert_array_equal(got, want)


def test_prefix_runs_of_the_worked_example():
  runs = jax.jit(blocks.prefix_runs)(jnp.asarray([EXAMPLE_SEG]), jnp.asarray([EXAMPLE_PRE]))
  assert runs.first_key[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 12, 12]
  assert runs.last_query[0].tolist() == [8, 8, 8, 5, 5, 8, 8, 8, 12, 12, 12, 12, 14, 14]
  assert runs.free_key[0].tolist() == [0, 0, 0, 0, 0, 5, 5, 5, 8, 8, 8, 8, 12, 12]
  assert runs.free_query[0].tolist() == [5, 5, 5, 5, 5, 8, 8, 8, 12, 12, 12, 12, 14, 14]


def test_tiles_computed_with_a_shared_prompt():
  """Blocks of 128, causal: prompt 3 blocks, chosen 2, rejected 2, padding 1."""
  seg = np.repeat([[1, 1, 1, 2, 2, 3, 3, 0]], 128, axis=1)
  pre = np.repeat([[0, 0, 0, 1, 1, 1, 1, 0]], 128, axis=1)
  count = jax.jit(functools.partial(blocks.tiles_computed, block_q=128, block_k=128,
                                    causal=True))
  assert int(count(jnp.asarray(seg))[0]) == 6 + 3 + 3  # each segment alone
  # prompt 6; chosen (4 + 5); rejected (6 + 7), its sibling's 2 x 2 tiles visited with the mask
  shared = int(count(jnp.asarray(seg), prefix_ids_BxS=jnp.asarray(pre))[0])
  assert shared == 6 + 9 + 13
  # the pairs unshared, prompt + branch as rows of 5 blocks: 15 tiles each, 10 blocks of slots
  assert shared < 2 * 15


class TestRefusals:
  q, k, v, _ = random_inputs(0, 1, 14, 2, 1, 16)
  seg = jnp.asarray([EXAMPLE_SEG])

  @pytest.mark.parametrize("pre,match", [
      ([0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 4, 4, 0, 0], r"segment 2 \(slots 3..4\) has prefix ids"),
      ([0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 6, 6, 0, 0], "names prefix segment 6, which is not in"),
      ([0, 0, 0, 5, 5, 1, 1, 1, 0, 0, 4, 4, 0, 0], "which does not lie entirely before it"),
      ([0, 0, 0, 1, 1, 2, 2, 2, 0, 0, 4, 4, 0, 0], r"which has a prefix itself \(1\)"),
      ([0, 0, 0, 2, 2, 1, 1, 1, 0, 0, 4, 4, 0, 0], "which does not lie entirely before it"),
  ])
  def test_checked_mode_refuses_broken_invariants(self, pre, match):
    with pytest.raises(NonContiguousSegmentsError, match="`prefix_segment_ids` row 0: .*" + match):
      segment_attention(self.q, self.k, self.v, self.seg, check_segments=True,
                        prefix_segment_ids=jnp.asarray([pre]))

  def test_checked_mode_under_jit_and_contiguity(self):
    f = jax.jit(lambda seg, pre: segment_attention(self.q, self.k, self.v, seg,
                                                   prefix_segment_ids=pre, check_segments=True))
    jax.block_until_ready(f(self.seg, jnp.asarray([EXAMPLE_PRE])))  # the example is valid
    bad = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 6, 6, 0, 0]])
    with pytest.raises(Exception, match="names prefix segment 6, which is not in the row"):
      jax.block_until_ready(f(self.seg, bad))
    reopened = jnp.asarray([[1, 1, 1, 2, 2, 1, 1, 1, 4, 4, 5, 5, 0, 0]])
    with pytest.raises(NonContiguousSegmentsError, match="reopens segment 1 at position 5"):
      segment_attention(self.q, self.k, self.v, reopened, check_segments=True,
                        prefix_segment_ids=jnp.asarray([EXAMPLE_PRE]))

  def test_cudnn_slot_index_and_context_axis_are_refused(self):
    pre = jnp.asarray([EXAMPLE_PRE])
    with pytest.raises(AttentionInputError, match="`prefix_segment_ids` is not supported by "
                       "implementation='cudnn'"):
      segment_attention(self.q, self.k, self.v, self.seg, prefix_segment_ids=pre,
                        implementation="cudnn", cudnn_segment_bound=8)
    with pytest.raises(AttentionInputError, match="`prefix_segment_ids` cannot be combined with "
                       "`slot_index`"):
      segment_attention(self.q, self.k, self.v, self.seg, prefix_segment_ids=pre,
                        slot_index=jnp.arange(14)[None])
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1), ("context",))
    with pytest.raises(AttentionInputError, match="cannot be combined with `context_axis`"):
      segment_attention(self.q, self.k, self.v, self.seg, prefix_segment_ids=pre, mesh=mesh,
                        batch_axis=None, head_axis=None, context_axis="context")

  def test_bad_shape_and_dtype(self):
    with pytest.raises(AttentionInputError, match=r"`prefix_segment_ids` shape \(1, 13\)"):
      segment_attention(self.q, self.k, self.v, self.seg,
                        prefix_segment_ids=jnp.zeros((1, 13), jnp.int32))
    with pytest.raises(AttentionTypeError, match="`prefix_segment_ids` must be an integer"):
      segment_attention(self.q, self.k, self.v, self.seg,
                        prefix_segment_ids=jnp.zeros((1, 14), jnp.float32))


def test_pallas_never_loads_the_blocks_of_another_pair():
  """NaN keys and values in the blocks of pair 1 stay out of pair 2's outputs: the kernel skips
  them with the prefix too; the dense kernel of the same family spreads them (the control)."""
  seg = np.repeat([[1, 2, 3, 4, 5, 6, 0, 0]], 32, axis=1)
  pre = np.repeat([[0, 1, 1, 0, 4, 4, 0, 0]], 32, axis=1)
  q, k, v, _ = random_inputs(5, 1, 256, 2, 1, 16)
  k, v = (x.at[0, :96].set(jnp.nan) for x in (k, v))
  common = dict(causal=True, scale=0.25, prefix_segment_ids_BxS=jnp.asarray(pre),
                pallas=_pallas_options(32, 32, 32, 32))
  out = segment_attention_pallas(q, k, v, jnp.asarray(seg), **common)
  dense = segment_attention_pallas(q, k, v, jnp.asarray(seg), skip_blocks=False, **common)
  assert np.all(np.isnan(np.asarray(dense)[0, 96:192]))
  want, _ = prefix_reference(q, jnp.nan_to_num(k), jnp.nan_to_num(v), seg, pre, causal=True,
                             scale=0.25)
  np.testing.assert_allclose(np.asarray(out)[0, 96:], want[0, 96:], atol=2e-5)


def _kernel_operands(fn, *args):
  """The operand counts of the Pallas calls in the jaxpr of `fn`, by kernel name."""
  found = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        name = re.search(r"segment_flash_\w+", str(eqn.params.get("name")))
        found[name.group(0)] = len(eqn.invars)
      for sub in jax_core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_without_prefix_the_kernels_take_no_new_input():
  """`prefix_segment_ids=None` leaves the kernels' inputs as they were; with it, the forward,
  dQ and dK/dV kernels take one more (the queries' prefix ids)."""
  seg, pre = jnp.asarray([EXAMPLE_SEG]), jnp.asarray([EXAMPLE_PRE])
  q, k, v, _ = random_inputs(0, 1, 14, 2, 1, 16)

  def grad(pre):
    fn = lambda q, k, v: segment_attention(q, k, v, seg, prefix_segment_ids=pre,
                                           implementation="pallas",
                                           pallas=_pallas_options(16, 16, 16, 16)).sum()
    return lambda q, k, v: jax.grad(fn, argnums=(0, 1, 2))(q, k, v)

  plain, shared = _kernel_operands(grad(None), q, k, v), _kernel_operands(grad(pre), q, k, v)
  assert set(plain) == set(shared) and len(plain) == 4
  for name, n in plain.items():
    assert shared[name] == n + (0 if "delta" in name else 1), name
  assert plain["segment_flash_fwd"] == 6  # ranges, segment ids (queries, keys), q, k, v


def test_pallas_with_prefix_lowers_to_triton_for_cuda():
  b, s, h, kh, d = 2, 1024, 8, 2, 64
  sd = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  args = (sd(b, s, h, d), sd(b, s, kh, d), sd(b, s, kh, d), sd(b, s, dt=jnp.int32),
          sd(b, s, dt=jnp.int32))

  def grad(q, k, v, seg, pre):
    loss = lambda q, k, v: segment_attention(q, k, v, seg, prefix_segment_ids=pre,
                                             implementation="pallas").astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  assert calls and set(calls) == {"__gpu$xla.gpu.triton"}
  for kernel in ("segment_flash_fwd", "segment_flash_bwd_dq", "segment_flash_bwd_dkv"):
    assert kernel in text, kernel


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_under_a_mesh_matches_the_oracle(implementation):
  """Batch over data x fsdp, heads over tensor (8 CPU devices): the prefix ids are split like
  the segment ids."""
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  seg, pre = pair_rows(np.random.default_rng(11), 4, 64)
  q, k, v, dout = random_inputs(12, 4, 64, 4, 2, 16)
  heads, rows = (NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None)),
                 NamedSharding(mesh, P(("data", "fsdp"), None)))
  kw = dict(pallas=_pallas_options(16, 16, 16, 16)) if implementation == "pallas" else {}
  fn = jax.jit(lambda seg, pre, *a: _fwd_bwd(seg, pre, *a, causal=True, mesh=mesh,
                                              implementation=implementation, **kw))
  out, grads = fn(*(jax.device_put(x, rows) for x in (seg, pre)),
                  *(jax.device_put(x, heads) for x in (q, k, v, dout)))
  assert out.sharding.is_equivalent_to(heads, 4)
  want, grads_want = prefix_reference(q, k, v, seg, pre, causal=True, dout=dout)
  _assert_matches(out, grads, want, grads_want)

"""train.state: the threefry kernel of initialisation programs, checked in the program
lowered for `cuda` on the CPU (the CUDA kernel's custom call, or XLA's inlined hash)."""

import types

import jax
import pytest

from train import state

KERNEL = "threefry2x32_ffi"  # the custom call of JAX's hand-written CUDA threefry kernel


def _draws(key):
  return jax.random.normal(key, (64, 32)) + jax.random.uniform(jax.random.fold_in(key, 1), (32,))


def _cuda_text() -> str:
  return jax.jit(_draws).trace(jax.random.key(0)).lower(lowering_platforms=("cuda",)).as_text()


def test_threefry_kernel_is_used_only_inside_and_only_when_enabled():
  assert KERNEL not in _cuda_text()  # negative control: XLA's own hash by default
  with state.threefry_kernel(enabled=True):
    assert KERNEL in _cuda_text()
    with state.threefry_kernel(enabled=False):
      assert KERNEL not in _cuda_text()
    assert KERNEL in _cuda_text()  # the outer setting is back
  assert KERNEL not in _cuda_text()
  with pytest.raises(RuntimeError), state.threefry_kernel(enabled=True):
    raise RuntimeError("an init that fails")
  assert not jax.config.jax_threefry_gpu_kernel_lowering  # restored after an error too


def test_the_kernel_draws_the_same_bits_as_the_default_lowering():
  key = jax.random.key(3)
  want = jax.jit(_draws)(key)
  with state.threefry_kernel(enabled=True):
    got = jax.jit(_draws)(key)
  assert (got == want).all()


@pytest.mark.parametrize("axes,kernel", [(dict(data=8, fsdp=1, tensor=1), True),
                                         (dict(data=1, fsdp=8, tensor=1), False),
                                         (dict(data=4, fsdp=1, tensor=2), False)])
def test_initial_state_uses_the_kernel_only_where_parameters_are_whole(monkeypatch, axes, kernel):
  seen = []
  monkeypatch.setattr(state, "_initial_state",
                      lambda *a, **k: seen.append(jax.config.jax_threefry_gpu_kernel_lowering))
  state.initial_state(None, "", None, None, None, vocab_size=8,
                      mesh=types.SimpleNamespace(shape=axes), segment_bound=None, adapters=False)
  assert seen == [kernel] and not jax.config.jax_threefry_gpu_kernel_lowering

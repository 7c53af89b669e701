"""`train.memory`: the estimate's parts by hand on a tiny config, its growth with the row and
the vocabulary, the config it reads (absent keys at their defaults), and `check_fits`'s one-line
refusal naming the keys that shrink the largest parts."""

from __future__ import annotations

import dataclasses

import pytest

from configs import packed
from segpack.errors import ArgumentError
from train import memory

TINY = dict(num_params=40_000, vocab_size=1_000, d_model=16, d_ff=32, num_layers=1, num_heads=1,
            num_kv_heads=1, head_dim=16, batch_rows=2, seq_len=8)


def _tiny(**overrides):
  return memory.estimate(**{**TINY, "loss_block": 0, "remat": "none", **overrides})


def test_the_parts_of_a_tiny_step_by_hand():
  est = _tiny()
  weights = 40_000 * 4
  assert (est.parameters, est.gradients, est.optimizer) == (weights, weights, 3 * weights)
  per_token = 4 * 16 + 2 * (1 + 2) * 16 + 16 + 4 * 32  # 304
  scores = 3 * 2 * 1 * 8 * 8 * 4  # 3 float32 [B, H, S, S]
  assert est.activations == 2 * 8 * per_token * 4 + scores == 20_992
  assert est.logits == 2 * (2 * 8) * 1_000 * 4 == 128_000
  assert est.total == 948_992 == sum(est.parts().values())
  assert not est.blocked


def test_blocks_remat_attention_and_dtypes_by_hand():
  blocked = _tiny(loss_block=4)
  assert blocked.logits == 1 * 4 * 1_000 * 4 and blocked.blocked
  assert _tiny(loss_block=4, loss_vocab_block=256).logits == 4 * 256 * 4
  assert _tiny(loss_block=64).logits == 16 * 1_000 * 4  # a block never exceeds B*S positions
  layer = 16 * 304 * 4 + 1_536
  two = dict(num_layers=2)
  assert _tiny(**two).activations == 2 * layer
  assert _tiny(**two, remat="full").activations == 2 * 16 * 16 * 4 + layer
  dots = 16 + 3 * 16 + 2 * 16 + 2 * 32  # input, q k v, o and down outputs, gate and up
  assert _tiny(**two, remat="dots").activations == 2 * 16 * dots * 4 + layer
  assert _tiny(attention="pallas").activations == 16 * 304 * 4 + 2 * 1 * 8 * 4
  half = _tiny(param_bytes=2, compute_bytes=2)
  assert half.parameters == 80_000 and half.activations == 16 * 304 * 2 + 1_536
  assert half.logits == 128_000  # the logits are float32 whatever the compute dtype
  assert _tiny(optimizer_states=0).optimizer == 160_000  # the update alone (SGD)


def test_the_blocked_logits_part_does_not_grow_with_the_row_or_the_vocabulary():
  blocked = [_tiny(seq_len=s, loss_block=4, loss_vocab_block=128, vocab_size=v).logits
             for s in (8, 64, 512) for v in (1_000, 2_000)]
  assert set(blocked) == {4 * 128 * 4}
  full = [_tiny(seq_len=s, loss_block=0).logits for s in (8, 64, 512)]
  assert full == [2 * 2 * s * 1_000 * 4 for s in (8, 64, 512)]


def test_table_and_line_name_every_part_in_gib():
  est = _tiny(num_params=2**28)  # 1 GiB of parameters
  lines = est.table().splitlines()
  assert [line.split()[0] for line in lines] == [*est.parts(), "total"]
  assert lines[0].split()[1:] == ["1.000", "GiB"]
  line = est.line()
  assert "\n" not in line and line.startswith("memory per device (estimate): 5.00 GiB")
  assert all(name in line for name in est.parts())


def test_bad_arguments_are_refused_by_name():
  with pytest.raises(ArgumentError, match=r"remat must be one of \['none', 'full', 'dots'\]"):
    _tiny(remat="all")
  with pytest.raises(ArgumentError, match="seq_len must be an int >= 1, got 0"):
    _tiny(seq_len=0)
  with pytest.raises(ArgumentError, match="loss_block must be an int >= 0, got -1"):
    _tiny(loss_block=-1)


def test_check_fits_refuses_in_one_line_naming_the_keys():
  est = _tiny(seq_len=512)  # logits 8.2 MB, scores 6.3 MB: the two largest parts
  memory.check_fits(est, est.total, what="case")
  memory.check_fits(est, None, what="case")  # nothing known: no check
  with pytest.raises(ArgumentError) as e:
    memory.check_fits(est, est.total - 1, what="configs/packed.py:gpu")
  message = str(e.value)
  assert "\n" not in message and message.startswith("configs/packed.py:gpu: one training step")
  assert "logits 0.01 GiB (loss.block_size, train.batch_size, packing.seq_len)" in message
  assert "activations 0.01 GiB (model.remat, train.batch_size" in message
  assert "packing.seq_len" in message and "parameters" not in message
  blocked = _tiny(num_params=10**8, loss_block=4)
  with pytest.raises(ArgumentError, match=r"optimizer 1\.12 GiB \(a smaller model, mesh.fsdp\)"):
    memory.check_fits(blocked, 2**20, what="case")
  # Under adapters the trained parameters are the adapters: a huge model.lora.rank is named, not
  # "a smaller model" (the message above, for the same sizes without a frozen base).
  adapted = dataclasses.replace(blocked, parameters=blocked.parameters + 2**30, adapters=True)
  with pytest.raises(ArgumentError, match=r"optimizer 1\.12 GiB \(model.lora.rank, "
                     r"model.lora.targets, mesh.fsdp\)") as e:
    memory.check_fits(adapted, 2**20, what="case")
  assert "a smaller model" not in str(e.value)
  huge_blocks = _tiny(seq_len=4096, loss_block=4096, num_layers=1, attention="pallas")
  with pytest.raises(ArgumentError, match=r"logits .* \(loss.block_size, loss.vocab_block_size\)"):
    memory.check_fits(huge_blocks, 2**20, what="case")


def test_from_config_reads_the_trainer_keys():
  config = packed.get_config("smoke")
  config.train.batch_size, config.train.grad_accum_steps = 16, 2
  config.loss.block_size, config.loss.vocab_block_size = 64, 100
  config.model.remat = "full"
  m = config.model
  shape = dict(d_model=m.d_model, d_ff=m.d_ff, num_layers=m.num_layers, num_heads=m.num_heads,
               num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)
  got = memory.from_config(config, num_params=5_000, vocab_size=2_048, devices=4, platform="gpu")
  want = memory.estimate(num_params=5_000, vocab_size=2_048, batch_rows=2, seq_len=128,
                         compute_bytes=2, loss_block=64, loss_vocab_block=100, remat="full",
                         attention="pallas", **shape)
  assert got == want
  on_cpu = memory.from_config(config, num_params=5_000, vocab_size=2_048, platform="cpu")
  assert on_cpu == memory.estimate(num_params=5_000, vocab_size=2_048, batch_rows=8, seq_len=128,
                                   loss_block=64, loss_vocab_block=100, remat="none", **shape)


def test_the_cpu_applies_no_remat():
  assert memory.applied_remat("full", platform="cpu") == "none"
  assert memory.applied_remat("dots", platform="gpu") == "dots"


def test_device_memory_on_the_cpu_is_the_available_host_memory():
  available = memory.device_memory()
  assert available is None or available > 0
  host = memory.host_memory()
  assert (available is None) == (host is None)
  if host is not None:
    assert abs(available - host) < 2**30  # read a moment apart

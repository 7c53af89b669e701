"""Everything a run sets up before its first step: checks, mesh, data, state, restore, steps.

Algorithm (`setup`):
  1. Check the config (`preflight`) and the workdir; build the mesh; the objective
     (`objective_of`) reads the data, each process its own rows.
  2. Derive the state's shardings from abstract shapes (`train.state`), then initialise it into
     them (jit), or restore the latest checkpoint (state + data position; its config must
     match), from any process count (the position is a row of the global stream).
  3. The objective prepares what it needs before step 1 (a reference's scores), and the train
     and eval steps are jitted with explicit shardings (`train.steps`, `train.state.jit_steps`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Callable

import grain
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from train import checkpoint as ckpt_lib
from train import checkpoint_digest as digest_lib
from train import config_checks
from train import data as data_lib
from train import memory as memory_lib
from train import objective as objective_lib
from train import recipe as recipe_lib
from train import run_guard
from train import sharding as sharding_lib
from train import state as state_lib
from train import steps as steps_lib
from train.adapters import trainable
from train.config_checks import check_attention, check_attention_leaks
from train.hf import init_from as hf_init
from train.preference import objective as preference_objective
from train.rl import objective as rl_objective
from train.run_guard import check_workdir


@dataclasses.dataclass
class Run:
  """Everything `train.train.train_and_evaluate` sets up before the loop."""

  config: Any
  config_dict: dict[str, Any]
  workdir: str
  mesh: Any
  data: data_lib.Data
  state: Any
  state_shardings: Any
  train_step: Callable[..., Any]
  eval_step: Callable[..., Any]
  checkpointer: ckpt_lib.Checkpointer
  iterator: Any
  start_step: int
  num_params: int
  objective: Any = None  # the run's `train.objective.Objective`, prepared
  graphdef: Any = None  # the decoder's graph: `train.model.lora.model_of(graphdef, params, base)`
  resume_changes: list[str] = dataclasses.field(default_factory=list)
  vocab_size: int = 0  # the model's: `model.vocab_size`, or the data's when that is None
  recipe: recipe_lib.Resolved | None = None  # how the length, rate and warmup were chosen
  memory: memory_lib.MemoryEstimate | None = None  # the step's estimated peak per device
  reference: str | None = None  # what the objective prepared before step 1 (its line)
  frozen_params: int = 0  # the frozen base's parameters under adapters (`num_params`: trained)


def objective_of(config: Any) -> objective_lib.Objective:
  """The objective a config asks for: a preference loss (`preference.loss`), an RL loss
  (`rl.loss`), else tokens."""
  if config.preference.loss != "none":
    return preference_objective.from_config(config)
  if config.rl.loss != "none":
    return rl_objective.from_config(config)
  return objective_lib.TokenObjective.from_config(config)


def preflight(config: Any) -> None:
  """The checks that need no data and write nothing: config values, the imported model's keys,
  the attention backend and its leak check."""
  config_checks.check_config(config)
  trainable.check(config)
  if config.model.init_from is not None:
    hf_init.check_adopted(config)
  implementation = check_attention(config.attention, platform=jax.default_backend())
  check_attention_leaks(config, implementation=implementation)


def check_tokenizer_first(config: Any) -> set[str]:
  """With `model.init_from`: the tokenizer of each local dataset of `data.train` (its manifest)
  is the model's, checked before the data is opened and planned, so that data of another
  tokenizer is refused for that, not for what follows from it (the rows a step needs, the
  vocabulary). Returns the tokenizer fingerprints found the model's; what cannot be read here
  is opened, and checked, with the data."""
  checked: set[str] = set()
  if config.model.init_from is None:
    return checked
  for path in run_guard.dataset_paths(config.data.train):
    try:
      manifest = json.loads((pathlib.Path(path) / "manifest.json").read_text("utf-8"))
      fingerprint = manifest["tokenizer_fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
      continue
    if isinstance(fingerprint, str) and fingerprint not in checked:
      hf_init.check_tokenizer(config.model.init_from, data_fingerprint=fingerprint,
                              data_name=f"data.train={path!r}")
      checked.add(fingerprint)
  return checked


def _data(config: Any, workdir: str, mesh: Any, objective: objective_lib.Objective):
  """Step 1's data and its checks: `(data, extra, resolved recipe, fingerprints)`."""
  t = config.train
  checked = check_tokenizer_first(config)
  data, extra = objective.make_data(config, mesh=mesh, batch_size=t.batch_size,
                                    process_index=jax.process_index(),
                                    process_count=jax.process_count())
  resolved = recipe_lib.resolve_config(  # metrics.announce prints it
      config, steps_per_epoch=data.train_rows_in_epoch0 / t.batch_size, started=_started(workdir))
  fingerprints = run_guard.data_fingerprints(train=config.data.train, eval_path=config.data.eval)
  run_guard.check_run_record(workdir, fingerprints)  # before a checkpoint can be blamed
  if config.model.init_from is not None and data.tokenizer_fingerprint not in checked:
    hf_init.check_tokenizer(config.model.init_from, data_fingerprint=data.tokenizer_fingerprint,
                            data_name=data_lib.data_name(config))
  return data, extra, resolved, fingerprints


def _started(workdir: str) -> dict[str, Any] | None:
  """The resolved `train` group this run started with (`WORKDIR/run.json`) when it resumes from
  a checkpoint; None for a run from scratch."""
  if not digest_lib.scan(os.path.join(workdir, "checkpoints")).steps:
    return None
  started = run_guard.run_record(workdir).get("config", {})
  return started.get("train") if isinstance(started, dict) else None


def _shardings(tx: Any, abstract: Any, mesh: Any) -> dict[str, Any]:
  """The state's `NamedSharding`s, from its abstract shapes."""
  params_sh = sharding_lib.param_shardings(abstract["params"], mesh)
  return dict(params=params_sh,
              opt_state=sharding_lib.opt_state_shardings(tx, abstract["params"], params_sh, mesh),
              step=NamedSharding(mesh, P()))


def setup(config: Any, workdir: str, *, checked: bool = False,
          objective: objective_lib.Objective | None = None) -> Run:
  """The module's algorithm (`checked`: `preflight` ran; `objective`: `objective_of(config)`)."""
  if not checked:
    preflight(config)
  workdir = check_workdir(workdir)
  t = config.train
  mesh = sharding_lib.make_mesh(data=config.mesh.data, fsdp=config.mesh.fsdp,
                                tensor=config.mesh.tensor, context=config.mesh.context)
  sharding_lib.check_batch(t.batch_size, mesh=mesh, grad_accum_steps=t.grad_accum_steps,
                           process_count=jax.process_count())
  objective = objective_of(config) if objective is None else objective
  data, extra, resolved, fingerprints = _data(config, workdir, mesh, objective)
  vocab_size = config_checks.check_vocab_size(config, data.vocab_size)
  tx, schedule = steps_lib.make_optimizer(t)
  graphdef, abstract, abstract_frozen = state_lib.abstract_state(
      config, tx, vocab_size=vocab_size, mesh=mesh, segment_bound=data.segment_bound)
  num_params = state_lib.count(abstract["params"])
  frozen = state_lib.frozen_base(config, abstract_frozen, mesh)  # before a resume's check
  estimate = memory_lib.check_run(config, num_params, vocab_size, mesh,  # before compiling
                                  frozen_bytes=frozen.bytes)
  state_sh = _shardings(tx, abstract, mesh)
  config_dict = json.loads(config.to_json())
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       every=t.checkpoint_every, max_to_keep=t.max_checkpoints,
                                       base=frozen.fingerprint)
  iterator = data.train_iterator(
      read_options=grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
  abstract_sh = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             abstract, state_sh)
  restored = checkpointer.restore_or_none(abstract_sh, config_dict)
  if restored is None:
    state, start_step, changes = state_lib.initial_state(
        config, workdir, abstract, state_sh, tx, vocab_size=vocab_size, mesh=mesh,
        segment_bound=data.segment_bound, adapters=frozen.params is not None), 0, []
  else:
    state, start_step, changes = restored.state, restored.step, restored.changes
    iterator.set_state(restored.data_state)
  live: dict[str, Run] = {}  # the run, once made: its current weights for `live_params`
  objective, line = objective.prepare(objective_lib.Prepared(  # before a step changes the weights
      config=config, workdir=workdir, data=data, extra=extra, graphdef=graphdef,
      reference_params=lambda: state_lib.base_params(state["params"], frozen), mesh=mesh,
      resumed=restored is not None,
      live_params=lambda: state_lib.current_params(live["run"].state["params"], frozen)))
  if jax.process_index() == 0:
    run_guard.keep_run_record(workdir, config_dict, fingerprints, fresh=restored is None)
    run_guard.keep_datasets(workdir, run_guard.training_dirs(config.data.train))
  train_step, eval_step = state_lib.jit_steps(
      steps_lib.make_train_step(graphdef, tx, schedule, accum=t.grad_accum_steps,
                                objective=objective, seed=t.seed),
      steps_lib.make_eval_step(graphdef, objective=objective), state_sh=state_sh,
      batch_sh=objective.batch_sharding(mesh), replicated=NamedSharding(mesh, P()),
      frozen=frozen)
  live["run"] = Run(config=config, config_dict=config_dict, workdir=workdir, mesh=mesh, data=data,
             state=state, state_shardings=state_sh, train_step=train_step, eval_step=eval_step,
             checkpointer=checkpointer, iterator=iterator, start_step=int(start_step),
             num_params=num_params, objective=objective, graphdef=graphdef,
             resume_changes=changes,
             vocab_size=vocab_size, recipe=resolved, memory=estimate, reference=line,
             frozen_params=frozen.num_params)
  return live["run"]

r"""Decodes from a run's newest intact checkpoint with a KV cache: `python -m train.sample`.

  python -m train.sample --workdir runs/packed_smoke --prompt "def "               # greedy
  python -m train.sample --workdir runs/packed --prompt "def " --prompt "class " \
      --temperature 0.8 --top_p 0.95 --num_samples 3                               # drawn
  python -m train.sample --workdir runs/sft --chat --prompt "What does zip do?"   # chat
  python -m train.sample --workdir runs/sft_hf --chat --tools tools.json \
      --prompt "Find the docs of zip"                                              # with tools
  python -m train.sample --workdir runs/sft_hf --chat --conversation chat.json   # next turn
  python -m train.sample --workdir runs/synthetic --prompt_ids 5,6,7               # prints ids
  python -m train.sample --benchmark                                               # tokens/s

Works for every run the trainer makes: the built-in corpora, a dataset or a mixture of datasets
(local or at a URL; the tokenizer is the copy inside the dataset), an imported Hugging Face
model. Prompts begin as the run's documents began (BOS when `data.add_bos`); `--chat` renders the
prompt as a user turn with the run's chat template (segpack's, or the model's own for data
rendered by it) and prints the assistant's answer, stopping at the end of its turn. All prompts
and samples decode together on the rollout engine (`train.rollout.engine`): every prompt is
prefilled once for all its samples, `--lanes` completions decode at once (a lane that ends takes
the next waiting one), and each answer is the one it would get alone. `--stop TEXT` ends an answer
where its text holds TEXT; `--output FILE` also writes every completion with its token ids,
log-probs and finish reason as JSON lines (`train.sample.output`).

With a model's own chat template (data tokenized with `--tokenizer hf:DIR`, or an imported
model's), `--tools FILE` offers tools to the model (a JSON list of tool schemas, or an object with a
`tools` list) and `--conversation FILE` gives a whole conversation (`{"messages": [...], "tools":
[...]}` or a list of messages, assistant `tool_calls` and `tool` results included, ending with a user
or tool message) whose next assistant turn the model answers; the prompt is the template's render
with the generation prompt and the tools, as `apply_chat_template(messages, tools=tools,
add_generation_prompt=True)` gives it. `--tools` wins over a conversation's own `tools`. segpack's
own template has no place for tools: both flags are refused there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags, logging

from segpack import errors
from segpack.text import chat
from train.rollout import engine
from train.rollout import sampling as sampling_lib
from train.sample import output as sample_output
from train.sample import prompts as sample_prompts
from train.sample.prompts import SampleError
from train.runs import saved as saved_run
from train.runs import loaded as loaded_run
from train.runs.saved import Checkpoint

PROG = "python -m train.sample"


@dataclasses.dataclass(frozen=True)
class Answer:
  """One decoded continuation: `prompt` (its index), `sample` (its draw), the new token ids, the
  text printed (the prompt and continuation, the chat answer, or ids without a tokenizer) and
  the engine's completion (`train.rollout.engine.Completion`: log-probs, finish reason)."""
  prompt: int
  sample: int
  new_ids: tuple[int, ...]
  text: str
  step: int = 0  # the checkpoint's step it came from (a newer one if the chosen one was deleted)
  completion: engine.Completion | None = None
  prompt_ids: tuple[int, ...] = ()  # the prompt as the model saw it (BOS, chat template)
  temperature: float = 1.0  # the temperature of the completion's `logprobs`


def sampling_of(*, temperature: float | None, top_k: int, top_p: float) -> sampling_lib.Sampling:
  """The command's settings as a `Sampling`: without `temperature`, 1.0 when `top_k > 1` or
  `top_p < 1` asks for a draw, else greedy (0)."""
  if temperature is None:
    temperature = 1.0 if top_k > 1 or top_p < 1 else 0.0
  try:
    return sampling_lib.Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
  except sampling_lib.DecodeError as e:
    raise SampleError(f"--{e}") from e


def _text(tokenizer: Any, prompt: list[int], done: engine.Completion, *, chat_mode: bool,
          stops: Sequence[int]) -> str:
  new = list(done.token_ids)
  if tokenizer is None:
    return ",".join(map(str, prompt)) + " | " + ",".join(map(str, new))
  if chat_mode:
    return done.text
  if done.finish_reason == "stop_string":  # the whole text, cut where the completion's is
    whole = tokenizer.decode(prompt + new)
    return whole[:whole.rfind(done.stop)]
  return tokenizer.decode(prompt + new)


def sample(workdir: str, *, prompts: Sequence[str] = (), prompt_ids: Sequence[str] = (),
           chat_mode: bool = False, system: str | None = None,
           conversation: chat.Conversation | Sequence[Mapping[str, Any]] | None = None,
           tools: Sequence[Mapping[str, Any]] | None = None, num_samples: int = 1,
           max_new_tokens: int = 64, sampling: sampling_lib.Sampling = sampling_lib.GREEDY,
           seed: int = 0, lanes: int | None = None, stop_strings: Sequence[str] = (),
           checkpoint: Checkpoint | None = None) -> list[Answer]:
  """Decodes continuations of the prompts from the newest intact checkpoint of `workdir`.

  Args:
    workdir: the run directory.
    prompts: prompt texts (encoded with the run's tokenizer).
    prompt_ids: or prompts as comma-separated token ids (the only way for synthetic runs).
    chat_mode: render each prompt as a user turn with the run's chat template (`--chat`).
    system: with `chat_mode`, a system message before the user turn.
    conversation: with `chat_mode`, instead of `prompts`: a whole conversation (a
      `chat.Conversation`, its `tools` included, or a list of messages) ending with a user or
      tool message; the model answers its next assistant turn (`--conversation`). Needs a run
      whose chat template is the model's own.
    tools: with `chat_mode`, the tools offered to the model (a list of JSON schemas) in each
      prompt or in `conversation`, whose own tools they replace (`--tools`). Needs a run whose
      chat template is the model's own.
    num_samples: draws per prompt (greedy decoding gives one), all from one prefill.
    max_new_tokens: the most new tokens per answer (any int >= 1): an answer stops where the
      run's rows end (`packing.seq_len` positions, prompt included).
    sampling: greedy or a draw (`train.rollout.sampling.Sampling`).
    seed: the seed of the draws.
    lanes: completions decoded at once (None: all of them, up to the engine's default); a lane
      that ends takes the next waiting completion.
    stop_strings: an answer ends once its text holds one of these, cut before it (`--stop`).
    checkpoint: the checkpoint to read (None: `choose_checkpoint(workdir)`).

  Returns:
    One `Answer` per prompt and sample, prompt by prompt.

  Raises:
    SampleError: no intact checkpoint, no prompt, a synthetic run without `prompt_ids`, a
      tokenizer that is not the model's, bad settings, a conversation or tools that are not
      valid, `conversation` / `tools` on a run rendered with segpack's own template, or a
      prompt that leaves no room for a new token in the run's rows.
  """
  for flag, value in (("--num_samples", num_samples), ("--max_new_tokens", max_new_tokens),
                      ("--lanes", 1 if lanes is None else lanes)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise SampleError(f"{flag} must be an int >= 1, got {value!r}")
  for stop in stop_strings:
    if not isinstance(stop, str) or not stop:
      raise SampleError(f"--stop must be a non-empty string, got {stop!r}")
  sample_prompts.check_request(texts=prompts, ids=prompt_ids, chat_mode=chat_mode,
                               system=system, conversation=conversation, tools=tools)
  if tools is not None:
    tools = sample_prompts.check_tools(list(tools) if isinstance(tools, tuple) else tools)
  conversation = (None if conversation is None
                  else sample_prompts.check_conversation(conversation))
  checkpoint = checkpoint or saved_run.choose_checkpoint(workdir)
  config, _ = saved_run.run_config(workdir, checkpoint=checkpoint)
  ids, stops, tokenizer, skip = sample_prompts.encode_prompts(
      config, workdir, texts=prompts, ids=prompt_ids, chat_mode=chat_mode, system=system,
      conversation=conversation, tools=tools)
  sample_prompts.check_room(ids, seq_len=int(config.packing.seq_len), flag=(
      "--prompt_ids" if prompt_ids else "--conversation" if conversation else "--prompt"))
  if stop_strings and tokenizer is None:
    raise SampleError(f"--stop {stop_strings[0]!r}: a run without a tokenizer decodes ids, "
                      f"not text; give stop ids through the data's EOS instead")
  config, model, step = loaded_run.load_run(workdir, checkpoint=checkpoint)
  if tokenizer is not None and tokenizer.vocab_size > model.cfg.vocab_size:  # more rows: fine
    raise SampleError(f"the run's tokenizer ({tokenizer.spec}) has {tokenizer.vocab_size} ids, "
                      f"the checkpoint's model {model.cfg.vocab_size}: not the run's tokenizer")
  try:
    done = engine.generate(
        model, ids, num_samples=1 if sampling.greedy else num_samples,
        max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, stop_ids=stops,
        stop_strings=stop_strings, lanes=lanes, max_len=config.packing.seq_len,
        detokenize=None if tokenizer is None else tokenizer.decode)
  except sampling_lib.DecodeError as e:
    raise SampleError(str(e)) from e
  return [Answer(prompt=c.prompt, sample=c.sample, new_ids=c.token_ids, step=step, completion=c,
                 prompt_ids=tuple(ids[c.prompt]), temperature=sampling.logprob_temperature,
                 text=_text(tokenizer, ids[c.prompt][skip:], c, chat_mode=chat_mode,
                            stops=stops)) for c in done]


def define_flags() -> dict[str, Any]:
  """The command's flags (defined when run as a program only, so importing defines none)."""
  return dict(
      workdir=flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/."),
      prompt=flags.DEFINE_multi_string("prompt", [], "Prompt text; repeat for several."),
      prompt_ids=flags.DEFINE_multi_string(
          "prompt_ids", [], "Prompt as comma-separated token ids (synthetic runs); repeatable."),
      chat=flags.DEFINE_bool("chat", False, "Render each prompt as a user turn with the run's "
                             "chat template and print the assistant's answer."),
      system=flags.DEFINE_string("system", None, "With --chat: a system message."),
      tools=flags.DEFINE_string(
          "tools", None, "With --chat: a JSON file of the tools offered to the model (a list of "
          "tool schemas, or an object with a 'tools' list), in each prompt or the conversation; "
          "needs a run rendered by the model's own chat template."),
      conversation=flags.DEFINE_string(
          "conversation", None, "With --chat, instead of --prompt: a JSON file holding a whole "
          "conversation ({\"messages\": [...], \"tools\": [...]} or a list of messages) ending "
          "with a user or tool message; the model answers the next assistant turn."),
      num_samples=flags.DEFINE_integer("num_samples", 3, "Draws per prompt (greedy gives one)."),
      max_new_tokens=flags.DEFINE_integer("max_new_tokens", 64, "Most new tokens per answer; an answer "
                                          "stops where the run's rows end (packing.seq_len)."),
      temperature=flags.DEFINE_float("temperature", None, "0: greedy; default 1 when --top_k "
                                     "or --top_p asks for a draw, else 0."),
      top_k=flags.DEFINE_integer("top_k", 0, "Draw among the k most likely (0: all)."),
      top_p=flags.DEFINE_float("top_p", 1.0, "Draw among the most likely up to this mass."),
      seed=flags.DEFINE_integer("seed", 0, "Seed of the draws."),
      lanes=flags.DEFINE_integer("lanes", None, "Completions decoded at once (default: all, "
                                 "up to 256); a lane that ends takes the next waiting one."),
      stop=flags.DEFINE_multi_string("stop", [], "End an answer once its text holds this "
                                     "string (cut before it); repeatable."),
      output=flags.DEFINE_string("output", None, "Also write every completion as a JSON line "
                                 "(ids, log-probs, finish reason) to this new file."),
      benchmark=flags.DEFINE_bool("benchmark", False, "Print tokens/s of the KV-cache decoder "
                                  "beside the full-forward one (train.sample.bench) and exit."))


def _run(values: dict[str, Any]) -> None:
  sampling = sampling_of(temperature=values["temperature"], top_k=values["top_k"],
                         top_p=values["top_p"])
  tools = None if values["tools"] is None else sample_prompts.read_tools(values["tools"])
  conversation = (None if values["conversation"] is None
                  else sample_prompts.read_conversation(values["conversation"]))
  sample_prompts.check_request(texts=values["prompt"], ids=values["prompt_ids"],
                               chat_mode=values["chat"], system=values["system"],
                               conversation=conversation, tools=tools)
  output = None if values["output"] is None else sample_output.check_output(values["output"])
  checkpoint = saved_run.choose_checkpoint(values["workdir"])  # warns of a damaged one skipped
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.ERROR)  # orbax warns about a manager it may not write to
  answers = sample(values["workdir"], prompts=values["prompt"], prompt_ids=values["prompt_ids"],
                   chat_mode=values["chat"], system=values["system"],
                   conversation=conversation, tools=tools,
                   num_samples=values["num_samples"], max_new_tokens=values["max_new_tokens"],
                   sampling=sampling, seed=values["seed"], lanes=values["lanes"],
                   stop_strings=values["stop"], checkpoint=checkpoint)
  mode = "greedy" if sampling.greedy else (
      f"temperature={sampling.temperature}, top_k={sampling.top_k}, top_p={sampling.top_p}")
  draws = max(a.sample for a in answers) + 1
  for a in answers:
    print(f"=== prompt {a.prompt + 1}, sample {a.sample + 1}/{draws} ({mode}) from step "
          f"{a.step} ===")
    print(a.text)
  if output is not None:
    sample_output.write(output, answers)


def main(argv: Sequence[str], *, holders: dict[str, Any]) -> None:
  """Runs the command on absl's parsed flags (`argv`: what absl left, the program first)."""
  if len(argv) > 1:
    raise errors.UsageError(f"unexpected arguments: {list(argv[1:])}")
  values = {name: holder.value for name, holder in holders.items()}
  if values["benchmark"]:
    from train.sample import bench as sample_bench  # optional: the benchmark's imports only when asked for
    workdir = values["workdir"]
    status = sample_bench.main(["--workdir", workdir] if workdir else [])
    if status:
      raise SystemExit(status)
    return
  if not values["workdir"]:
    raise errors.UsageError("give --workdir (a run directory), or --benchmark")
  _run(values)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with a mistake (an unknown flag, a bad value) as a `UsageError`."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    raise errors.UsageError(str(e).strip().splitlines()[0]) from e


@errors.command(PROG)
def cli(argv: Sequence[str] | None = None) -> int:
  """`python -m train.sample`: absl's flags, then `main`, ending as `segpack.errors.command`
  says (a mistake in one line, exit code 2)."""
  app.run(functools.partial(main, holders=define_flags()), argv=argv, flags_parser=parse_flags)
  return 0

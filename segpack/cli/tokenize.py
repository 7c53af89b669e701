"""`segpack tokenize`: tokenize text into a shard dataset (see docs/format.md).

Usage:
  segpack tokenize --input builtin --output DIR
  segpack tokenize --input a.jsonl.gz b.txt --output DIR --vocab-size 8192
  segpack tokenize --input corpus/ --output DIR --spm-model m.model --workers 8
  segpack tokenize --input data/*.parquet hf-disk:saved/train --text-field text --output DIR \
      --vocab-size 8192
  segpack tokenize --input corpus/ --output DIR --tokenizer hf:path/to/tokenizer.json
  segpack tokenize --input corpus/ --output DIR --spm-model m.model --runner beam \
      --beam-options "--runner=DirectRunner --direct_num_workers=4"

(`python -m segpack tokenize ...` is the same command.) `--input builtin` (or `builtin:small`) is
the built-in corpus of this Python's docs and sources; see `segpack.text` for the formats and
resuming.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from segpack import errors
from segpack.text.beam.pipeline import DEFAULT_UNIT_RECORDS
from segpack.text.beam.remote import tokenize_remote
from segpack.text.beam.remote_inputs import remote_flags
from segpack.text.chat.hf_chat.options import DEFAULT_DATE, REASONING, TURNS, ChatOptions
from segpack.text.dataset import CHAT_TEMPLATES
from segpack.text.dataset import refuse_chat_template
from segpack.text.dataset import tokenize_files
from segpack.text.encode import DEFAULT_SHARD_TOKENS


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="segpack tokenize",
                              description="Tokenize text into a segpack shard dataset.")
  p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                 help=".txt, .jsonl (each also .gz or .zst) and .parquet files, directories of "
                      "them, hf-disk:PATH (a datasets save_to_disk directory, hf-disk:PATH/SPLIT "
                      "for a DatasetDict); or builtin[:small]")
  p.add_argument("--output", required=True, metavar="DIR")
  tok = p.add_mutually_exclusive_group()
  tok.add_argument("--spm-model", metavar="FILE", help="an existing SentencePiece model")
  tok.add_argument("--vocab-size", type=int, metavar="N",
                   help="train a SentencePiece model of N pieces on the input first")
  tok.add_argument("--tokenizer", metavar="KIND:FILE",
                   help="hf:FILE or hf:DIR, a Hugging Face tokenizer.json or the model "
                        "directory holding it (needs segpack[hf]; special ids from "
                        "tokenizer_config.json beside it), or spm:FILE (= --spm-model)")
  p.add_argument("--doc-separator", choices=("file", "blank-line"), default="file",
                 help=".txt files: a file is a document, or blank lines separate documents")
  p.add_argument("--text-field", default="text",
                 help=".jsonl: the field holding the text; .parquet, hf-disk: the column")
  p.add_argument("--format", choices=("auto", "text", "chat", "preference", "prompts"),
                 default="auto",
                 help="preference: .jsonl pairs (prompt, chosen, rejected; docs/preference.md); "
                      "prompts: .jsonl prompts for RL (a text or messages, with their other "
                      "fields kept for the rewards; docs/rl.md); "
                      "chat: .jsonl conversations with a loss mask, in the chat template of "
                      "--tokenizer hf:DIR when DIR holds one (needs segpack[hf]), else segpack's "
                      "(see --chat-template); "
                      "auto: chat when the first record has --messages-field and no --text-field")
  p.add_argument("--train-on", choices=("assistant", "last_assistant", "all"),
                 default="assistant", help="chat: which tokens carry loss")
  p.add_argument("--messages-field", default="messages", help="chat: the field of the messages")
  p.add_argument("--chat-template", choices=CHAT_TEMPLATES, default="auto",
                 help="chat: the template conversations are rendered with; auto: the chat "
                      "template of --tokenizer hf:DIR when DIR holds one, else segpack's; own: "
                      "DIR's (refused without one); segpack: segpack's even when DIR holds one")
  own = p.add_argument_group("chat in a tokenizer's own template (docs/sft.md)")
  own.add_argument("--turns", choices=TURNS, default="auto",
                   help="auto: a conversation whose template renders earlier turns otherwise "
                        "once later ones follow (Qwen3's reasoning, Mistral's system prompt) is "
                        "stored as one sample per assistant turn, each as the model sees it "
                        "when it answers; others whole; expand: always per turn; whole: refuse "
                        "what cannot be kept whole")
  own.add_argument("--reasoning", choices=REASONING, default="train",
                   help="train or mask an assistant turn's reasoning block (reasoning_content "
                        "as the template writes it, e.g. <think>...</think>)")
  own.add_argument("--chat-date", default=DEFAULT_DATE, metavar="YYYY-MM-DD",
                   help=f"the date templates read (Llama's date_string, strftime_now), recorded "
                        f"in the manifest (default {DEFAULT_DATE})")
  own.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="render with this Jinja chat template instead of the tokenizer's own "
                        "(e.g. a training template with {%% generation %%} markers); the dataset "
                        "keeps it as chat_template.jinja")
  p.add_argument("--skip-bad-lines", action="store_true",
                 help="count and skip records without usable text (.jsonl lines that are not "
                      "JSON or lack the field, null or non-string cells; chat: conversations "
                      "that are refused); unreadable files still stop the run")
  p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: CPUs)")
  p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                 help=f"target tokens per shard (default {DEFAULT_SHARD_TOKENS})")
  p.add_argument("--overwrite", action="store_true",
                 help="rebuild the dataset at --output, also a finished one: replaces one made "
                      "from other inputs or settings, repairs missing or damaged files")
  p.add_argument("--cache-dir", default=None,
                 help="cache for the built-in corpus's model (default $SEGPACK_CACHE or "
                      "~/.cache/segpack)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  beam = p.add_argument_group("Apache Beam (docs/ingest.md)")
  beam.add_argument("--runner", choices=("local", "beam"), default="local",
                    help="local: worker processes on this machine; beam: an Apache Beam "
                         "pipeline (needs segpack[beam])")
  beam.add_argument("--beam-options", default="", metavar="FLAGS",
                    help="Beam pipeline flags in one string, e.g. \"--runner=DataflowRunner "
                         "--project=P --region=R\" (default: the DirectRunner)")
  beam.add_argument("--unit-records", type=int, default=DEFAULT_UNIT_RECORDS, metavar="N",
                    help=f"beam: documents per work unit (default {DEFAULT_UNIT_RECORDS})")
  return p


def _tokenize_urls(args: argparse.Namespace) -> list | None:
  """With a URL among the paths: `beam.remote.tokenize_remote` (Beam's filesystems,
  docs/ingest.md; the local runner refuses URLs in one line); else None."""
  if not remote_flags(paths=[*args.input, args.output, args.spm_model, args.tokenizer]):
    return None
  refuse_chat_template(args.chat_template, why="a run with a path at a URL tokenizes plain "
                                                "text, runner='beam' (--runner)",
                       options=_chat_options(args))
  return [tokenize_remote(
      args.input, args.output, runner=args.runner, spm_model=args.spm_model,
      tokenizer=args.tokenizer, vocab_size=args.vocab_size, doc_separator=args.doc_separator,
      text_field=args.text_field, skip_bad_lines=args.skip_bad_lines,
      shard_tokens=args.shard_tokens, unit_records=args.unit_records,
      beam_options=args.beam_options, overwrite=args.overwrite, input_format=args.format,
      cache_dir=args.cache_dir)]


def join_beam_options(argv: Sequence[str]) -> list[str]:
  """`--beam-options "--runner=X ..."` as `--beam-options=--runner=X ...`: argparse would read a
  value that starts with `--runner=` as segpack's own `--runner` (it splits at `=` before it
  looks for spaces), so the documented spelling could not run."""
  out, args = [], list(argv)
  for i, arg in enumerate(args):
    if i and args[i - 1] == "--beam-options" and out and out[-1] == "--beam-options":
      out[-1] = f"--beam-options={arg}"
    else:
      out.append(arg)
  return out


def _say_segpack_lines() -> None:
  """segpack's log lines from INFO up on stderr, as `segpack tokenize: ...`; other libraries'
  (Beam logs to the root logger) keep Python's default: warnings and errors, as they are."""
  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter("segpack tokenize: %(message)s"))
  ours = logging.getLogger("segpack")
  if not ours.handlers:
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)


def _chat_options(args: argparse.Namespace) -> ChatOptions | None:
  """The flags of rendering in a tokenizer's own template (None when all are the defaults)."""
  options = ChatOptions(turns=args.turns, reasoning=args.reasoning, date=args.chat_date,
                        template_file=args.chat_template_file)
  return None if options == ChatOptions() else options


@errors.command("segpack tokenize")
def main(argv: Sequence[str] | None = None) -> int:
  """Runs the CLI; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
  args = _parser().parse_args(join_beam_options(sys.argv[1:] if argv is None else argv))
  if not logging.getLogger().handlers:
    _say_segpack_lines()
  if args.runner == "beam":  # Beam logs every stage at INFO.
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
  try:
    summaries = _tokenize_urls(args) or tokenize_files(
        args.input, args.output, spm_model=args.spm_model, vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        doc_separator=args.doc_separator, text_field=args.text_field,
        skip_bad_lines=args.skip_bad_lines, workers=args.workers, shard_tokens=args.shard_tokens,
        progress=not args.no_progress, overwrite=args.overwrite, cache_dir=args.cache_dir,
        input_format=args.format, train_on=args.train_on, messages_field=args.messages_field,
        runner=args.runner, beam_options=args.beam_options, unit_records=args.unit_records,
        chat_template=args.chat_template, chat_options=_chat_options(args))
  except (ValueError, OSError) as e:  # InputFormatError, ShardFormatError, missing files.
    if not errors.is_user_error(e):
      raise  # a bug: `errors.command` prints its traceback and asks to report it
    # One line, whatever the message holds (a library's message may span several).
    print(f"segpack tokenize: error: {errors.one_line(e)}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("segpack tokenize: interrupted; rerun the same command to resume", file=sys.stderr)
    return 130
  for summary in summaries:
    print(summary.table())
  return 0

"""Text to tokens: readers, tokenizers, chat templates, the built-in corpora, encoding.

Modules, in the order they depend on each other: `inputs` (file readers; `arrow_inputs` for
Parquet and `hf-disk:`, `input_errors` their errors), `tokenizers` (SentencePiece, a Hugging Face
tokenizer.json, the `Tokenizer` protocol), `input_ranges` (input files cut into parts that
workers read), `encode` (worker processes writing shards), `tokenizers.cache` (models trained on
first use), `chat` (templates and loss masks, `--format chat` and `--format preference`),
`corpus` and `chat.corpus` (the built-in corpora), `beam` (`--runner beam`), `dataset`
(`tokenize_files`, what `segpack tokenize` runs).
"""

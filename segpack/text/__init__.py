"""Text to tokens: readers, SentencePiece, chat templates, the built-in corpora, encoding.

Modules, in the order they depend on each other: `inputs` (file readers), `spm` (SentencePiece),
`hf` (a Hugging Face tokenizer.json), `tokenizer_spec` (the `Tokenizer` protocol, `from_spec`),
`input_ranges` (input files cut into parts that workers read), `encode` (worker processes
writing shards), `tokenizer_cache` (models trained on first use),
`chat` (templates and loss masks), `corpus` and `chat_corpus` (the built-in corpora),
`dataset` (`tokenize_files`, what `segpack tokenize` runs).
"""

"""Tokenizers: SentencePiece, a Hugging Face tokenizer.json, and the models trained on first use.

Modules: `spm` (SentencePiece: deterministic training, the tokenizer, the cache root),
`spm_proto` (a SentencePiece model file's pieces, read without protobuf), `hf` (a Hugging Face
`tokenizer.json`), `spec` (the `Tokenizer` protocol, `from_spec`), `cache` (models trained on
first use and cached).
"""

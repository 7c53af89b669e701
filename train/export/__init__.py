"""A finished run written out for other tools: a Hugging Face model directory (safetensors
shards, config.json, tokenizer files) or a PEFT adapter directory (docs/hf.md)."""

"""A finished run read back: its newest intact checkpoint, its config, its model, its tokenizer
and chat template (for `train.sample` and `train.export`)."""

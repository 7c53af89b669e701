"""Decoding from a run: the KV-cache decoder, its full-forward reference, the `python -m
train.sample` command and its benchmark."""

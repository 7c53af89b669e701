"""Hugging Face interop: a config.json <-> the model.* keys, safetensors weights in and out,
`model.init_from`, and `python -m train.export` (a run as a Hugging Face directory)."""

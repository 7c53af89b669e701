"""The trainer's benchmarks: `python -m train.bench packed|sft`, `python -m
train.bench.revisions`, `python -m train.bench.hf_import`."""

"""`python -m train.bench packed|sft|preference`: the training benchmarks (`train.bench.training`)."""

import sys

from train.bench import training

sys.exit(training.main())

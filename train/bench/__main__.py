"""`python -m train.bench packed|sft`: the training benchmarks (`train.bench.training`)."""

import sys

from train.bench import training

sys.exit(training.main())

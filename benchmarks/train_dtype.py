"""Entry point: python benchmarks/train_dtype.py (same as `agoq bench train-dtype`)."""

import sys

from agoq.bench.train_dtype import main

sys.exit(main())

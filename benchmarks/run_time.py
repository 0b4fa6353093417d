"""Entry point: python benchmarks/run_time.py (same as `agoq bench run-time`)."""

import sys

from agoq.bench.run_time import main

sys.exit(main())

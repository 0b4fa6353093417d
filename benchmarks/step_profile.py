"""Entry point: python benchmarks/step_profile.py (same as `agoq bench step-profile`)."""

import sys

from agoq.bench.step_profile import main

sys.exit(main())

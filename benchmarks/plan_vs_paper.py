"""agoq plan beside the paper's measured memory (same as ``agoq bench plan-vs-paper``)."""

from agoq.bench.plan_vs_paper import main

raise SystemExit(main())

"""LM head + cross-entropy: plain vs fused chunked loss (same as ``agoq bench loss``)."""

from agoq.bench.loss import main

raise SystemExit(main())

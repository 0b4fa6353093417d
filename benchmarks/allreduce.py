"""8-bit vs fp32/bf16 all-reduce, locally and over two tc-shaped network namespaces (same as ``agoq bench allreduce``)."""

from agoq.bench.allreduce import main

raise SystemExit(main())

"""Kernel bandwidth, torch path vs Triton, against a same-bytes copy (same as ``agoq bench kernels``)."""

from agoq.bench.kernels import main

raise SystemExit(main())

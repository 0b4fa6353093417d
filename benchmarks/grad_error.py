"""Relative gradient error by layer kind under quantized saved activations (same as ``agoq bench grad-error``)."""

from agoq.bench.grad_error import main

raise SystemExit(main())

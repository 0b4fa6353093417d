"""Saved-for-backward bytes per decoder layer, bf16 vs agoq vs uniform4 (same as ``agoq bench activation``)."""

from agoq.bench.activation import main

raise SystemExit(main())

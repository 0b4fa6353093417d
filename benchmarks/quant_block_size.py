"""Quantization error vs bits per value by block size on real activations and gradients (same as ``agoq bench quant-block-size``)."""

from agoq.bench.quant_block_size import main

raise SystemExit(main())

"""Quantize/dequantize throughput of every format vs a plain copy (same as ``agoq bench quant-throughput``)."""

from agoq.bench.quant_throughput import main

raise SystemExit(main())

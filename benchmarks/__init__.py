"""The measurements behind every number in the README, outside the installed ``agoq`` package.

One module per benchmark, run from the repository root as ``python -m benchmarks.NAME [args]``
(``python -m benchmarks`` lists them). Each has ``DESCRIPTION``, ``add_arguments(parser)``,
``run(args) -> int`` and ``main(argv)``, and writes one JSON result (with the command that
produced it, the git revision, the machine and the date; ``_common.write_result``) into
``benchmarks/results/``, ``$AGOQ_RESULTS_DIR``, or the folder given by ``--out-dir``. ``readme``
rewrites the README's result tables from those files. The benchmarks import agoq; nothing in
agoq imports them (``tests/test_layering.py``).
"""

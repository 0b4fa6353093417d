"""``python -m agoq`` is the ``agoq`` command."""

from agoq.cli import console_main

console_main()

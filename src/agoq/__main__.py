"""``python -m agoq`` is the ``agoq`` command."""

import sys

from agoq.cli import main

sys.exit(main())

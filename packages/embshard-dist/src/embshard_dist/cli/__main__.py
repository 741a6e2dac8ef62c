"""``python -m embshard_dist.cli``: the ``embshard`` command without its script."""

import sys

from embshard_dist.cli import console_main

sys.exit(console_main())

"""``python -m embshard_dist.cli``: the ``embshard`` command without its script."""

import sys

from embshard_dist.cli import main

sys.exit(main())

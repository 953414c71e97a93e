"""``python -m dtkv.demo``: see :mod:`dtkv.demo`."""

from __future__ import annotations

import sys

from dtkv.demo._cli import main

sys.exit(main())

"""Keep a checkout of this repository off sys.path.

`python -m batchgen` from a checkout, and Ray's workers (which put the driver's working directory
on their path), make the checkout's kernels/ folder the top-level `kernels`. That shadows PyPI's
`kernels`, which transformers (5.25 on) depends on and imports. batchgen's own code is the
installed package, so such entries are dropped before transformers is imported."""
from __future__ import annotations

import os
import sys


def drop_checkouts() -> None:
    """Remove every sys.path entry that is a checkout of this repository (has kernels/_common.py)."""
    sys.path[:] = [p for p in sys.path
                   if not os.path.isfile(os.path.join(os.path.abspath(p or "."), "kernels", "_common.py"))]

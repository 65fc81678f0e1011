import os
import sys

# `python -m batchgen` puts the working directory first on sys.path. In a checkout of this
# repository that makes its kernels/ folder the top-level `kernels`, shadowing the PyPI package
# that transformers imports; batchgen's own code is the installed package, so drop that entry.
if sys.path and os.path.isfile(os.path.join(os.path.abspath(sys.path[0] or "."), "kernels", "_common.py")):
    del sys.path[0]

from batchgen.cli import main  # noqa: E402

main()

"""The C++ CPU ops build wherever there is a compiler. Their tests skip where the ops are not
available (no compiler: the engine keeps the torch path), so without this a compile error in
kernels/csrc would turn hundreds of op tests into skips and the suite would still pass."""
import os
import shutil

import pytest

from batchgen.kernels import cpu_attention

COMPILER = cpu_attention.compiler()


@pytest.mark.skipif(os.environ.get("BATCHGEN_NO_CPP") == "1", reason="BATCHGEN_NO_CPP=1: the ops are turned off")
@pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no C++ compiler ({COMPILER}) here")
def test_the_cpu_ops_build_where_there_is_a_compiler():
    cpu_attention.load()  # raises with the compiler's message when the sources do not build

"""Triton kernels for the CUDA path (imported as batchgen.kernels).

Each module holds a plain torch reference, the Triton kernel and a launcher that checks shapes,
strides and dtypes. On a CPU they run under Triton's interpreter (TRITON_INTERPRET=1) in tests.
"""

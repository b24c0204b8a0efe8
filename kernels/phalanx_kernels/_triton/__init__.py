"""Triton implementations. Imported only when a Triton path runs, never by `import phalanx_kernels`.

Each module here imports triton at the top and defines its kernels with `@triton.jit`. Triton
decides at definition time whether a kernel is compiled or interpreted (`TRITON_INTERPRET=1`),
so defining them lazily lets tests set that variable before the first kernel exists.
"""

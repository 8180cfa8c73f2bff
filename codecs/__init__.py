"""zipmoe.codecs: bf16 bit fields, exponent codecs, the .zmoe container, entropy analysis.

Imports no torch model code. Depends only on numpy, zstandard, lz4, xxhash and
``zipmoe.kernels.cpu`` for the fast split/merge loops.
"""

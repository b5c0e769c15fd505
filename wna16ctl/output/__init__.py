"""Writing a repack output: planned safetensors files, the streams that fill them, and OUT itself.

* `writer`: files planned from headers before any tensor exists, positioned writes, hashes, the atomic commit.
* `filestream`: one output file written front to back through reused page-aligned blocks (O_DIRECT where it can).
* `outdir`: what repack may create, replace and delete around an output directory.

Knows nothing of layouts: it writes the tensors it is given.
"""

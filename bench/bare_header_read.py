"""The yardstick for `inspect`: a bare Python read of a checkpoint's headers, nothing checked.

Reads config.json and the shard index with json.loads, then every shard's 8-byte header length
and its JSON header (json.loads), one file after another, and prints the tensor count.  No
validation, no planning: the least any tool that looks at every header must do in Python.

    python bench/bare_header_read.py CHECKPOINT_DIR
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1])
    json.loads((root / "config.json").read_bytes())
    index = json.loads((root / "model.safetensors.index.json").read_bytes())
    tensors = 0
    for rel in dict.fromkeys(index["weight_map"].values()):
        with open(root / rel, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            tensors += len(json.loads(f.read(n))) - 1  # less __metadata__
    print(tensors)


if __name__ == "__main__":
    main()

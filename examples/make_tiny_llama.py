"""Regenerate examples/tiny-llama: a 2-layer Llama (8 heads, 2 kv heads, vocab 250) saved by
transformers, small enough to keep in git (~180 KB). Needs the test extra (transformers).

    python examples/make_tiny_llama.py examples/tiny-llama
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from checkpoints import make_checkpoint  # noqa: E402

if __name__ == "__main__":
    make_checkpoint(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/tiny-llama"), "llama", max_shard_size="100KB")

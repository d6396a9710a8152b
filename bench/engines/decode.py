#!/usr/bin/env python
"""Decode latency of one attention layer (issue 6); the same as ``mlaconv bench decode``.

    python -m bench.engines.decode                          # default: 2 shapes × fp32/bf16 × 1K…32K
    python -m bench.engines.decode --contexts 16K --dtypes bfloat16 --shapes llama2-7b --repeats 9 --json
"""

import sys

from mlaconv.cli import main

if __name__ == "__main__":
    sys.argv[1:1] = ["bench", "decode"]
    main()

#!/usr/bin/env python3
"""Run run.py's cases with memshelf and a reference command side by side and report ratios
(reference time / memshelf time, so 5.0× means memshelf is five times faster).

    python3 bench/compare.py --sizes 10000 [--ref-cmd /path/to/memshelf] [--repeat 7] [--md]

Every run.py option works here; --ref is implied. The reference defaults to memshelf-mcp
0.4.0's CLI at /tmp/ref040/bin/memshelf, its MCP server to memshelf-mcp next to it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402


if __name__ == "__main__":
    sys.exit(run.main(sys.argv[1:], force_ref=True))

#!/usr/bin/env python3
"""patch_kv_layout from a checkout: python tools/patch_kv_layout.py --help (same as the console script)."""

import sys
from pathlib import Path

try:
    from ort_kvlayout.tools.cli import patch_main
except ImportError:  # not installed: use the checkout's sources (no custom-op library then)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from ort_kvlayout.tools.cli import patch_main

if __name__ == "__main__":
    sys.exit(patch_main())

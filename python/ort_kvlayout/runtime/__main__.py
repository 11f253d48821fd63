"""python -m ort_kvlayout.runtime MODEL_DIR --prompt TEXT ... (see cli.py)."""

import sys

from .cli import main

sys.exit(main())

"""`python -m ort_kvlayout ...` is the `ort-kvlayout` command (serve/cli.py), for environments
whose scripts directory is not on PATH."""

import sys

from .serve.cli import main

sys.exit(main())

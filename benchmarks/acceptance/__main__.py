"""``python -m acceptance`` from benchmarks/ (the same as ``python benchmarks/gpu_acceptance.py``)."""

import sys

from .runner import main

sys.exit(main())

"""``python -m benchmarks.protocol``."""

import sys

from benchmarks.protocol import main

sys.exit(main())

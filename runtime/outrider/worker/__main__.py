"""`python -m outrider.worker ADDRESS SPEC_JSON`: a worker process (child.py)."""

import sys

from .child import main

sys.exit(main())

"""`python -m dynamograph.cli` is the `dynamograph` command."""

import sys

from .main import main

sys.exit(main())

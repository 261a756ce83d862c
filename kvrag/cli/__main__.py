"""`python -m kvrag.cli`."""

import sys

from kvrag.cli import main

sys.exit(main())

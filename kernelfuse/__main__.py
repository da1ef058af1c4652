"""`python -m kernelfuse` is the `kernelfuse` command."""

import sys

from kernelfuse.cli import main

sys.exit(main())

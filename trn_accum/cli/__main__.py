"""`python -m trn_accum.cli`: the same as `trn-accum`."""

import sys

from trn_accum.cli import main

sys.exit(main())

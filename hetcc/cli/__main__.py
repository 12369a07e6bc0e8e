"""``python -m hetcc.cli``: the ``hetcc`` command."""

import sys

from hetcc.cli import main

sys.exit(main())

"""``python -m latentserve.cli ...`` runs the ``latentserve`` command."""

import sys

from latentserve.cli import main

sys.exit(main())

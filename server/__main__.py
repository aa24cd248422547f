"""`python -m server`: the same as `simmer serve`."""

import sys

from server.cli.serve import main

sys.exit(main())

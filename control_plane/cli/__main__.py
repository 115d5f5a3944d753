"""``python -m control_plane.cli``: the ``kervan`` command without its script."""

import sys

from control_plane.cli.commands import main

sys.exit(main())

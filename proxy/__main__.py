"""`python -m proxy`: same as the `mcp-tasks-proxy` command."""

import sys

from .cli import main

sys.exit(main())

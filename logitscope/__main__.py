"""``python -m logitscope`` runs the command line."""

import sys

from logitscope.cli import main

sys.exit(main())

"""``python -m ldlm.cli``."""

import sys

from ldlm.cli import main

sys.exit(main())

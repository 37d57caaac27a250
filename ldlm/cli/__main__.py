"""``python -m ldlm.cli``."""

import sys

from ldlm.cli import main

status = main()
# CPython run with -m ends the process by SIGINT (status -2 to its parent) once a KeyboardInterrupt has
# left any exec() of a string, even when it is caught further up: a Ctrl-C that lands while an import
# defines a dataclass leaves that mark, and main() has already reported it, in one line, with 130. Each
# exec() of a string clears the mark as it starts.
exec("")
sys.exit(status)

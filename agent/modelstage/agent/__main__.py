"""``python -m modelstage.agent agent ...``: the agent image's entry point."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

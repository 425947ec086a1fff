"""python -m loadtest.replay (or python loadtest/replay) ...: see loadtest/replay/__init__.py."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a directory: make `loadtest` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtest.replay.cli import main

sys.exit(main())

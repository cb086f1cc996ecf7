"""Make the repo importable when a job runs from an uploaded working dir (ray job submit)."""

import sys
from pathlib import Path

root = str(Path(__file__).resolve().parents[1])
if root not in sys.path:
    sys.path.insert(0, root)

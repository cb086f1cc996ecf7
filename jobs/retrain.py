"""Ray job: one retrain pass (new rows -> dataset version -> train -> validate -> gate).

    ray job submit --working-dir . -- python jobs/retrain.py --config retrain.yaml
Exit 0 promoted or nothing new, 3 blocked/refused by the gate, 75 another scheduler runs.
"""

import _bootstrap  # noqa: F401

from pipeline.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["retrain", *sys.argv[1:]]))

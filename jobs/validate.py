"""Ray job: validate a draft artifact against a serving configuration.

    ray job submit --working-dir . -- python jobs/validate.py --config validate.yaml [--json]
Exit code 0 = pass, 3 = block (reasons printed), 2 = unusable input.
"""

import _bootstrap  # noqa: F401

from pipeline.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["validate", *sys.argv[1:]]))

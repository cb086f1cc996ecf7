"""Ray job: the target's own responses for a conversations file (regeneration).

ray job submit --working-dir . -- python jobs/regenerate.py --config regenerate.yaml
python jobs/regenerate.py --config regenerate.yaml        # starts a local Ray
"""

import _bootstrap  # noqa: F401

from pipeline.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["regenerate", *sys.argv[1:]]))

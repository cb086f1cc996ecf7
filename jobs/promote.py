"""Ray job: promote a draft artifact to a channel; exit 3 when refused (reasons printed).

ray job submit --working-dir . -- python jobs/promote.py DIGEST --channel production --registry s3://...
"""

import _bootstrap  # noqa: F401

from pipeline.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["promote", *sys.argv[1:]]))

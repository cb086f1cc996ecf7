"""Ray job: extract hidden states with provenance into Parquet.

ray job submit --working-dir . -- python jobs/extract.py --config extract.yaml
python jobs/extract.py --config extract.yaml        # starts a local Ray
"""

import _bootstrap  # noqa: F401

from pipeline.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["extract", *sys.argv[1:]]))

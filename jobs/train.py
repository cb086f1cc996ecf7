"""Ray job: train an EAGLE-3 draft with DeepSpeed workers on Ray Train, then export it.

ray job submit --working-dir . -- python jobs/train.py --config train.yaml
python jobs/train.py --config train.yaml          # starts a local Ray
"""

import _bootstrap  # noqa: F401

from pipeline.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["train", *sys.argv[1:]]))

"""Ray job: which layers was a draft trained elsewhere trained on, and will the deployment feed them?

    ray job submit --working-dir . -- python jobs/probe.py --draft DIR --target DIR [--config probe.yaml] [--json]
Exit code 0 = inferred (or, with a serving section, fed as trained), 3 = the deployment feeds other
layers (the fix printed), 4 = inconclusive, 2 = unusable input.
"""

import _bootstrap  # noqa: F401

from pipeline.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["probe", *sys.argv[1:]]))

"""The demo's plumbing: a quiet terminal (children's logs in the log file) and no mixing of an
older demo's directory into a new run. The demo's stages are tested where they live
(pretrain, extract, train, validate, cost)."""

from __future__ import annotations

import subprocess
import sys

from pipeline.demo.story import DEMO_VERSION, _quiet, demo_root


def test_quiet_sends_the_process_and_its_children_to_the_log(tmp_path, capfd):
    log = tmp_path / "demo.log"
    with _quiet(log) as story:
        print("story line", file=story)
        print("library chatter")  # Python's stdout
        print("more chatter", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"], check=True
        )  # an engine subprocess
    out, err = capfd.readouterr()
    assert "story line" in out
    for noise in ("library chatter", "more chatter", "child out", "child err"):
        assert noise not in out and noise not in err
        assert noise in log.read_text()
    print("after")  # the terminal is back
    assert "after" in capfd.readouterr().out


def test_an_older_demo_directory_is_moved_aside_not_mixed_in(tmp_path):
    root = tmp_path / "strata-demo"
    root.mkdir()
    (root / "train.yaml").write_text("epochs: 2\n")  # written by an older demo
    got = demo_root(root)
    assert got == root and (root / ".strata-demo-version").read_text().strip() == DEMO_VERSION
    assert not (root / "train.yaml").exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("strata-demo.old-")]
    assert len(aside) == 1 and (aside[0] / "train.yaml").read_text() == "epochs: 2\n"
    (root / "extract.yaml").write_text("x")
    demo_root(root)  # same version: kept
    assert (root / "extract.yaml").exists()


def test_a_handler_bound_inside_the_quiet_block_keeps_writing_to_the_log(tmp_path, capfd):
    """vLLM binds its log handler to the sys.stdout of its import (inside the demo's quiet block):
    its shutdown messages at exit go to the log, not "--- Logging error ---" on a closed file."""
    import logging

    log = tmp_path / "demo.log"
    late = logging.getLogger("strata-test-late")
    late.propagate = False
    with _quiet(log):
        late.addHandler(logging.StreamHandler(sys.stdout))
    try:
        late.warning("engine shutdown chatter")
        out, err = capfd.readouterr()
        assert "Logging error" not in err and "chatter" not in out + err
        assert "engine shutdown chatter" in log.read_text()
    finally:
        late.handlers.clear()

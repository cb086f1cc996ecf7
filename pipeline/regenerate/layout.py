"""Where a regeneration job puts things inside its output directory."""

UNITS_DIR = "_units"
JOB_FILE = "_job.json"


def unit_paths(unit: int) -> tuple[str, str]:
    """(the unit's conversations, its commit record)."""
    return f"{UNITS_DIR}/unit-{unit:05d}.jsonl", f"{UNITS_DIR}/unit-{unit:05d}.json"

"""The README is a newcomer's path, so what it shows must run: each job's minimal config is
valid for that job's schema, every document it points to exists, and it stays short."""

import re
from pathlib import Path

import pytest
import yaml

from schemas.extract import ExtractConfig
from schemas.regenerate import RegenerateConfig
from schemas.retrain import RetrainConfig
from schemas.train import TrainConfig
from schemas.validation import ValidateConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_each_minimal_config_in_the_readme_is_valid_for_its_job():
    blocks = re.findall(r"```yaml\n(.*?)```", README, re.S)
    schemas = [RegenerateConfig, ExtractConfig, TrainConfig, ValidateConfig, RetrainConfig]
    assert len(blocks) == len(schemas)
    for block, schema in zip(blocks, schemas, strict=True):
        schema.model_validate(yaml.safe_load(block))


@pytest.mark.parametrize(
    "doc",
    [
        "README.md",
        *(str(p.relative_to(ROOT)) for p in ROOT.glob("pipeline/*/README.md")),
        "infra/README.md",
        "tests/README.md",
        "tests/benchmarks/README.md",
    ],
)
def test_every_linked_document_exists_and_no_history_or_issue_numbers(doc):
    text = (ROOT / doc).read_text()
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / doc).parent.joinpath(link).exists(), f"{doc} links to {link}, which does not exist"
    assert not re.search(r"\(issue \d+\)|issue \d+'s|went from", text), doc


def test_the_readme_stays_a_newcomers_path():
    assert len(README) < 15_000
    first_screen = README[: README.index("## The pipeline")]
    assert "bash .ci/setup && .venv/bin/strata demo" in first_screen
    assert "bash .ci/setup && .venv/bin/python -m pytest -q -ra --durations=25" in first_screen

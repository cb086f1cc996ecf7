"""What every job configuration shares -- strict models, the target, S3 -- and loading a YAML
file with errors that name the field. Each job's own configuration is in its module
(``schemas.extract``, ``schemas.train``, ``schemas.validation``, ``schemas.retrain``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file and field."""


class Strict(BaseModel):
    """Unknown keys are errors: a typo in a config must not silently become a default."""

    model_config = ConfigDict(extra="forbid")


class TargetConfig(Strict):
    path: str = Field(description="local HF-format model directory (no downloads)")
    name: str | None = Field(None, description="display name; defaults to the directory name")
    revision: str | None = None


class S3Config(Strict):
    """Endpoint settings, one object for datasets, runs and registries; credentials come only from
    the environment (never written)."""

    endpoint_url: str | None = Field(None, description="None: AWS_ENDPOINT_URL if set, else AWS's own")
    region: str = "us-east-1"

    def endpoint(self) -> str | None:
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")


M = TypeVar("M", bound=BaseModel)


def format_validation_error(err: ValidationError, where: str) -> str:
    lines = [f"{where}: invalid configuration"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = e.get("input")
        got_s = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
        lines.append(f"  {loc}: {e['msg']}{got_s}")
    return "\n".join(lines)


def load_config(path: str | Path, model: type[M]) -> M:
    """Read a YAML config and validate it; relative paths stay as written."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(raw).__name__}")
    return validate_config(raw, model, where=str(p))


def validate_config(raw: dict, model: type[M], where: str = "config") -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where)) from None

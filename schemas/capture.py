"""Typed capture points: what a stored tensor *is*, never a bare integer.

For a decoder with N layers numbered 0..N-1 the residual stream is named by boundary:
``r_k`` enters layer k (pre-norm, residual included), ``r_0`` is the embedding output,
``r_N`` is the last layer's output before the final norm, ``o_j = r_{j+1}``, and
``final post-norm = norm(r_N)`` is what the LM head reads. Engines disagree about what
an integer means (see ``pipeline.conventions``, which also owns the boundary arithmetic:
``conventions.boundary``, ``position``, ``sort_key``); this type does not.

Canonical string forms (used as Parquet column names and in configs):
``embedding``, ``layer_output:<j>``, ``final:pre_norm``, ``final:post_norm``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

CaptureKind = Literal["embedding", "layer_output", "final"]
NormSide = Literal["pre", "post"]

_LAYER_RE = re.compile(r"^layer_output:(\d+)$")


class CapturePointError(ValueError):
    """A capture point that is malformed or does not exist in the target."""


class CapturePoint(BaseModel):
    """One tensor in the target's forward pass, named independently of any engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: CaptureKind
    layer: int | None = None
    norm: NormSide | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> CapturePoint:
        if self.kind == "layer_output":
            if self.layer is None or self.layer < 0:
                raise ValueError("layer_output needs a non-negative 'layer'")
            if self.norm is not None:
                raise ValueError("layer_output takes no 'norm'")
        elif self.kind == "final":
            if self.norm is None:
                raise ValueError("final needs norm='pre' or norm='post'")
            if self.layer is not None:
                raise ValueError("final takes no 'layer'")
        elif self.layer is not None or self.norm is not None:
            raise ValueError("embedding takes neither 'layer' nor 'norm'")
        return self

    # -- constructors -------------------------------------------------------------
    @classmethod
    def embedding(cls) -> CapturePoint:
        return cls(kind="embedding")

    @classmethod
    def layer_output(cls, layer: int) -> CapturePoint:
        return cls(kind="layer_output", layer=layer)

    @classmethod
    def final(cls, norm: NormSide) -> CapturePoint:
        return cls(kind="final", norm=norm)

    @classmethod
    def parse(cls, text: str) -> CapturePoint:
        """Parse the canonical string form; the error lists the accepted forms."""
        t = text.strip()
        if t == "embedding":
            return cls.embedding()
        if t in ("final:pre_norm", "final:post_norm"):
            return cls.final("pre" if t == "final:pre_norm" else "post")
        m = _LAYER_RE.match(t)
        if m:
            return cls.layer_output(int(m.group(1)))
        raise CapturePointError(
            f"unknown capture point {text!r}: expected 'embedding', 'layer_output:<j>' "
            "(output of decoder layer j, counted from 0), 'final:pre_norm' or 'final:post_norm'"
        )

    # -- views --------------------------------------------------------------------
    def __str__(self) -> str:
        if self.kind == "embedding":
            return "embedding"
        if self.kind == "layer_output":
            return f"layer_output:{self.layer}"
        return f"final:{self.norm}_norm"

    def validate_for(self, num_layers: int) -> CapturePoint:
        """Check the point exists in a target with ``num_layers`` decoder layers."""
        if num_layers <= 0:
            raise CapturePointError(f"num_layers must be positive, got {num_layers}")
        if self.kind == "layer_output" and self.layer >= num_layers:  # type: ignore[operator]
            raise CapturePointError(
                f"capture point {self} does not exist: the target has {num_layers} decoder "
                f"layers, numbered from 0 (layer_output:<j> needs j < {num_layers})"
            )
        return self


def parse_points(items: list[str | CapturePoint | dict]) -> list[CapturePoint]:
    """Parse a list of capture points given as strings, dicts or CapturePoints."""
    out: list[CapturePoint] = []
    for item in items:
        if isinstance(item, CapturePoint):
            out.append(item)
        elif isinstance(item, str):
            out.append(CapturePoint.parse(item))
        else:
            out.append(CapturePoint.model_validate(item))
    return out

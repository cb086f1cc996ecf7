"""Capture points as residual-stream boundaries: the index arithmetic the rest of Strata asks for.

``r_k`` enters decoder layer k (``r_0`` is the embedding output, ``r_N`` the last layer's output
before the final norm) and ``layer_output:j`` is ``r_{j+1}``; ``final:post_norm`` is no boundary
(it follows the final norm). Ordering, equality of tensors and EAGLE-3's default boundaries are
all defined here, once.
"""

from __future__ import annotations

from schemas.capture import CapturePoint


def boundary(point: CapturePoint, num_layers: int) -> int | None:
    """Residual-stream boundary k (``r_k``) the point equals; None for the final post-norm."""
    point.validate_for(num_layers)
    if point.kind == "embedding":
        return 0
    if point.kind == "layer_output":
        return point.layer + 1  # type: ignore[operator]
    return num_layers if point.norm == "pre" else None


def position(point: CapturePoint, num_layers: int) -> int:
    """Index along the forward pass: r_0 .. r_N, then the final post-norm at N+1."""
    b = boundary(point, num_layers)
    return num_layers + 1 if b is None else b


def same_tensor(a: CapturePoint, b: CapturePoint, num_layers: int) -> bool:
    """True when both names denote the same physical tensor (``layer_output:N-1`` is r_N pre-norm)."""
    if a == b:
        return True
    ka, kb = boundary(a, num_layers), boundary(b, num_layers)
    return ka is not None and ka == kb


def sort_key(point: CapturePoint, num_layers: int) -> tuple[int, int]:
    """Order along the forward pass: boundaries ascending, a ``final:`` name after its equal, post-norm last."""
    return position(point, num_layers), int(point.kind == "final")


def eagle3_default(num_layers: int) -> list[int]:
    """EAGLE-3's default aux boundaries r[2, N//2, N-3], in that order (duplicates kept: a shallow
    target repeats one; engines that merge repeats say so in their rules)."""
    return [2, num_layers // 2, num_layers - 3]

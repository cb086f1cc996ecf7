"""The promotion gate's numeric check: which tensor will the engine feed each draft slot,
and do its values match what the draft was trained on?

For every slot, the replayed serving target's boundaries r_0..r_N and final post-norm are
compared with the slot's training fingerprints (relative L2 in sketch space). The fed
boundary must match within tolerance and beat every other boundary by a clear factor;
otherwise the report names the boundary the training values do match.
"""

from __future__ import annotations

import torch

from pipeline import conventions
from pipeline.fingerprint import rel_l2
from schemas.capture import CapturePoint
from schemas.validation import SlotCheck, Tolerances


def label(point: CapturePoint, n: int) -> str:
    b = conventions.boundary_label(point, n)
    if point.kind == "layer_output":
        return f"o_{point.layer} ({b})"
    return {"embedding": "embedding (r_0)", "final": f"final {point.norm}-norm ({b})"}[point.kind]


def check_slots(
    trained: list[CapturePoint],
    fed: list[CapturePoint | None],
    fingerprints: dict[str, torch.Tensor],
    replayed: dict[str, torch.Tensor],
    n: int,
    tol: Tolerances,
    fed_by: str = "rule",
    predicted: list[CapturePoint] | None = None,
    unmatched: list[str] | None = None,
    alternatives: list[list[CapturePoint]] | None = None,
) -> list[SlotCheck]:
    """``fingerprints``: slot point -> training sketch; ``replayed``: boundary point -> sketch.

    ``fed``: per slot, the boundary the engine feeds -- measured (``fed_by="measured"``; None
    where the fed values match no boundary, described by ``unmatched``) or from its rule.
    ``alternatives``: per slot, other points the draft may as well have been trained on (a tie the
    probe left open); the slot passes when the feed matches any of them.
    """
    out = []
    for s, t in enumerate(trained):
        f = fed[s] if s < len(fed) else None
        extra = {"fed_by": fed_by, "predicted": predicted[s] if predicted and s < len(predicted) else None}
        could_be = [t, *alternatives[s]] if alternatives and s < len(alternatives) and alternatives[s] else []
        checks = [
            _check_slot(s, c, f, fingerprints, replayed, n, tol, len(fed), len(trained), unmatched)
            for c in could_be or [t]
        ]
        c = next((x for x in checks if x.ok), checks[0])
        if could_be:
            tie = f"one of {', '.join(label(p, n) for p in could_be)}, which the probe could not tell apart"
            c.message += f" ({tie})" if c.ok else f"; nor is it any other it may have been trained on ({tie})"
        out.append(c.model_copy(update={**extra, "could_be": could_be}))
    return out


def _check_slot(
    s: int,
    t: CapturePoint,
    f: CapturePoint | None,
    fingerprints: dict[str, torch.Tensor],
    replayed: dict[str, torch.Tensor],
    n: int,
    tol: Tolerances,
    n_fed: int,
    n_slots: int,
    unmatched: list[str] | None,
) -> SlotCheck:
    """Slot ``s``, trained on ``t``, fed ``f``: the fed boundary must match ``t``'s training values within
    tolerance and beat every other boundary by ``neighbour_factor``."""
    ref = fingerprints[str(t)]
    errs = {str(b): rel_l2(replayed[str(b)], ref) for b in conventions.all_boundaries(n) if str(b) in replayed}
    best = min(errs, key=errs.get)
    if f is None:
        msg = (
            f"slot {s}: the values the engine feeds match {unmatched[s]}"
            if unmatched and s < len(unmatched)
            else f"slot {s}: the engine feeds no tensor here (it reads {n_fed} aux ids, the draft has {n_slots} slots)"
        )
        return SlotCheck(slot=s, trained=t, fed=None, errors=errs, best=best, ok=False, message=msg)
    fk = conventions.boundary(f, n)
    fkey = str(f) if fk is None else str(conventions.boundary_point(fk, n))
    fed_err = errs[fkey]
    ok = fed_err <= tol.match_rel_l2 and all(e >= tol.neighbour_factor * fed_err for k, e in errs.items() if k != fkey)
    if ok:
        msg = f"slot {s}: fed {label(f, n)}, matches its training values (rel L2 {fed_err:.4f})"
    elif errs[best] <= tol.match_rel_l2:
        bp = CapturePoint.parse(best)
        shift = conventions.position(f, n) - conventions.position(bp, n)
        msg = (
            f"slot {s} is fed {label(f, n)} (rel L2 {fed_err:.3f} vs its training values), but the draft was "
            f"trained on {label(t, n)}, whose values match {label(bp, n)} (rel L2 {errs[best]:.4f})"
            + (f": shifted by {shift:+d}" if shift else "")
        )
    else:
        msg = (
            f"slot {s}: the training values of {label(t, n)} match no boundary of the serving target "
            f"(closest {label(CapturePoint.parse(best), n)} at rel L2 {errs[best]:.3f} > tolerance "
            f"{tol.match_rel_l2}): other target weights, or a dtype/numerics change beyond tolerance"
        )
    return SlotCheck(slot=s, trained=t, fed=f, errors=errs, best=best, ok=ok, message=msg)


def fix_hint(
    trained: list[CapturePoint],
    engine: str,
    n: int,
    family: str,
    release: str = conventions.NEWEST,
    runner: str | None = None,
) -> str:
    """What to write so the engine release feeds exactly the trained points."""
    try:
        ids = conventions.aux_ids_for(trained, engine, n, family, release, runner)  # type: ignore[arg-type]
    except conventions.ConventionError as e:
        return f"{engine} cannot be configured to feed these points: {e}"
    where = f"eagle_config.{conventions.AUX_KEY}" if engine == "sglang" else f"top-level {conventions.AUX_KEY}"
    return f"for {engine} write {where}={ids}"

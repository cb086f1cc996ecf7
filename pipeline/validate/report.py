"""Human report: Markdown with the slot x boundary alignment table, and a heatmap image of
the same matrix -- the picture that shows a shifted layer id at a glance."""

from __future__ import annotations

from pathlib import Path

from pipeline import conventions
from pipeline.acceptance import acceptance_length, line
from pipeline.validate.cost import table_lines
from pipeline.validate.gate import label
from schemas.acceptance import Acceptance
from schemas.capture import CapturePoint
from schemas.validation import AcceptanceSection, ValidationReport


def summary(r: ValidationReport, indent: str = "  ") -> list[str]:
    """The terminal verdict: decision, what the engine reads, each slot, identity, acceptance, reasons."""
    e, f = r.engine_reads, r.feed
    lines = [
        f"{r.decision.upper()}: artifact {r.artifact_digest[:16]} for {r.serving['engine']} "
        f"{r.serving['engine_version']} ({r.serving['dtype']}), serving key {r.serving_key}",
        f"{indent}{e.rule or r.serving['engine']} reads {e.key} = {e.ids} -> rule predicts {e.labels}",
    ]
    if r.provenance.get("summary"):
        lines.append(f"{indent}trained points {r.provenance['trained_points']}: {r.provenance['summary']}")
    if f.measured:
        lines.append(f"{indent}measured feed ({f.measured_with}): prefill {f.prefill}; verify steps {f.verify}")
    elif f.not_measured:
        lines.append(f"{indent}feed not measured: {f.not_measured}")
    lines += [f"{indent}RULE TABLE DISAGREES: {x}" for x in f.disagreements]
    lines += [f"{indent}note {x}" for x in f.verify_deviations]
    lines += [f"{indent}{'ok ' if s.ok else 'BAD'} {s.message}" for s in r.slots]
    lines += [f"{indent}BAD identity {c.message}" for c in r.identity if not c.ok]
    a = r.acceptance
    if a.measured is not None:
        lines += [f"{indent}acceptance, {name}: {line(m)}" for name, m in measurements(a)]
        lines.append(
            f"{indent}  lossless (same tokens as target-only greedy): {a.measured.lossless}"
            + (
                f"; training accuracy predicted mean length "
                f"{acceptance_length(a.predicted_accepted_per_step):.2f} (reported, not gated)"
                if a.predicted_accepted_per_step is not None
                else ""
            )
        )
        vs = a.vs_heldout
        if vs is not None and vs.measured is not None:
            lines.append(
                f"{indent}  vs training: {vs.measured:.2f} accepted per step here, {vs.heldout:.2f} at "
                f"training (first {vs.k} positions; gate threshold {vs.threshold:.2f}"
                f"{'' if vs.gated else ', not gated: ' + (vs.why or '')})"
            )
    lines += [f"{indent}- {x}" for x in r.reasons]
    if r.cost is not None:
        lines.append(
            f"{indent}what this configuration would cost ({r.cost.measured_by or ''}, "
            f"{r.cost.prompts or 0} held-out prompts, report only):"
        )
        lines += [f"{indent}  {x}" for x in table_lines(r.cost)]
    if r.report_dir:
        lines.append(f"{indent}report: {r.report_dir}/report.md (heatmap {r.report_dir}/heatmap.png)")
    return lines


def measurements(a: AcceptanceSection) -> list[tuple[str, Acceptance]]:
    """The acceptance measurements a report holds, one definition (``pipeline.acceptance``): the
    draft served as configured, the reference decoding fed the same points, and training's."""
    out: list[tuple[str, Acceptance]] = []
    if a.served is not None:
        out.append(("served as configured", a.served))
    if a.reference is not None:
        name = "reference decoding, the points the engine feeds" if a.served is not None else "reference decoding"
        out.append((name, a.reference))
    if a.heldout_at_training is not None:
        out.append(("at training, held-out prompts", a.heldout_at_training))
    return out


def acceptance_table(a: AcceptanceSection) -> list[str]:
    """The report's acceptance section: one Markdown row per measurement."""
    if a.measured is None:
        return [f"not measured: {a.skipped or 'no acceptance prompts'}"]
    rows = [
        "| configuration | measured by | prompts | verify steps | mean length +- SE | per position |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in measurements(a):
        se = f" +- {m.se:.2f}" if m.se is not None else ""
        per = " ".join(f"{x:.2f}" for x in m.acceptance_per_pos) if m.acceptance_per_pos else "-"
        rows.append(
            f"| {name} | {m.measured_by} | {m.prompts if m.prompts is not None else '-'} | "
            f"{m.verify_steps} | {m.mean_acceptance_length:.2f}{se} | {per} |"
        )
    notes = [f"- lossless: {a.measured.lossless}" + (f" ({a.lossless_note})" if a.lossless_note else "")]
    if a.predicted_accepted_per_step is not None:
        notes.append(
            f"- training accuracy predicts a mean length of "
            f"{acceptance_length(a.predicted_accepted_per_step):.2f} (teacher-forced; reported, not gated)"
        )
    vs = a.vs_heldout
    if vs is not None and vs.measured is not None:
        notes.append(
            f"- vs training: {vs.measured:.2f} accepted per step here, {vs.heldout:.2f} at training "
            f"(gate threshold {vs.threshold:.2f}{'' if vs.gated else '; not gated: ' + (vs.why or '')})"
        )
    return [*rows, "", *notes]


def write_report(r: ValidationReport, n: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(r.model_dump_json(indent=1))
    heatmap(r, n, out / "heatmap.png")
    names = [str(p) for p in conventions.all_boundaries(n)]
    short = [conventions.boundary_label(CapturePoint.parse(x), n) for x in names]
    lines = [
        f"# Strata validation: **{r.decision.upper()}**",
        "",
        f"- artifact `{r.artifact_digest[:16]}`, serving `{r.serving['engine']} {r.serving['engine_version']}` "
        f"({r.serving['dtype']}, TP {r.serving['tp_size']}, key `{r.serving_key}`)",
        f"- {r.engine_reads.rule or 'the engine'} reads `{r.engine_reads.key}` = `{r.engine_reads.ids}` "
        f"-> its rule predicts {r.engine_reads.labels} ({r.engine_reads.source or ''})",
        *([f"- measured feed: prefill {r.feed.prefill}; verify steps {r.feed.verify}"] if r.feed.measured else []),
        *(f"- **rule table disagrees**: {x}" for x in r.feed.disagreements),
        *(f"- note (not blocking): {x}" for x in r.feed.verify_deviations),
        "",
    ]
    if r.reasons:
        lines += ["## Why it is blocked", ""] + [f"- {x}" for x in r.reasons] + [""]
    lines += [
        "## Slot alignment (relative L2 of the replayed target vs the training values)",
        "",
        "(n/c: a boundary the serving engine cannot capture)",
        "",
        "| slot | trained on | fed | " + " | ".join(short) + " |",
        "|---|---|---|" + "---|" * len(short),
    ]
    for s in r.slots:
        cells = []
        for name in names:
            v = s.errors.get(name)
            cells.append("n/c" if v is None else f"**{v:.3f}**" if name == s.best else f"{v:.3f}")
        fed = label(s.fed, n) if s.fed else "-"
        trained = " or ".join(label(p, n) for p in s.could_be) if s.could_be else label(s.trained, n)
        lines.append(f"| {s.slot} {'ok' if s.ok else 'BAD'} | {trained} | {fed} | " + " | ".join(cells) + " |")
    lines += ["", "![slot x boundary error](heatmap.png)", "", "## Identity", ""]
    lines += [f"- {'ok' if c.ok else 'MISMATCH'}: {c.message}" for c in r.identity]
    lines += [
        "",
        "## Acceptance",
        "",
        *acceptance_table(r.acceptance),
        "",
        *(
            [
                "## What this configuration would cost (measured, report only)",
                "",
                r.cost.note or "",
                "",
                "```",
                *table_lines(r.cost),
                "```",
                "",
            ]
            if r.cost is not None
            else []
        ),
        "## Tolerances and calibration",
        "",
        "```",
        *(f"{k}: {v}" for k, v in r.tolerances.items()),
        *(f"{k}: {v}" for k, v in r.calibration.items()),
        "```",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


def heatmap(r: ValidationReport, n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [str(p) for p in conventions.all_boundaries(n)]
    # a boundary the serving engine cannot capture (SGLang llama: the embedding) has no error: blank
    m = np.array([[s.errors.get(x, np.nan) for x in names] for s in r.slots])
    fig, ax = plt.subplots(figsize=(1.0 + 0.55 * len(names), 1.2 + 0.6 * len(r.slots)))
    im = ax.imshow(np.clip(m, 0, 1.5), cmap="viridis_r", aspect="auto")
    ax.set_xticks(range(len(names)), [conventions.boundary_label(CapturePoint.parse(x), n) for x in names], rotation=45)
    ax.set_yticks(
        range(len(r.slots)), [f"slot {s.slot}\ntrained {conventions.boundary_label(s.trained, n)}" for s in r.slots]
    )
    for s in r.slots:
        if s.fed is not None:
            k = conventions.boundary(s.fed, n)
            x = names.index("final:post_norm") if k is None else k
            ax.add_patch(
                plt.Rectangle((x - 0.5, s.slot - 0.5), 1, 1, fill=False, ec="red" if not s.ok else "white", lw=2.5)
            )
        for j, v in enumerate(m[s.slot]):
            if np.isnan(v):
                continue
            ax.text(j, s.slot, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v > 0.7 else "black")
    ax.set_title(f"{r.decision.upper()}: rel. L2 to training values (box = what the engine feeds)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

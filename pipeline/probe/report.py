"""The probe's answer in words, for a terminal."""

from __future__ import annotations

from schemas.probe import ProbeReport


def summary(r: ProbeReport) -> list[str]:
    head = {
        "inferred": "INFERRED",
        "inconclusive": "INCONCLUSIVE",
        "declared": "DECLARED",
        "pass": "PASS",
        "block": "BLOCK",
    }[r.verdict]
    lines = [f"{head}  {r.draft} ({r.layout} layout) for {r.target} ({r.num_layers} layers)", f"  {r.summary}"]
    claimed = "; ".join(f"{k} = {v}" for k, v in r.claimed.items()) or "none (engines would use their defaults)"
    lines.append(f"  ids in the config: {claimed}")
    lines.append(
        f"  evidence: {r.prompts} prompts, {r.positions} assistant tokens, {r.evaluated} candidate sets; per TTT "
        f"step, the draft's loss (nats per token) best {[-f for f in r.best.fit]}, runner-up "
        f"{[-f for f in r.runner_up.fit]}; its agreement best {r.best.agreement}, runner-up {r.runner_up.agreement}"
    )
    for e in r.slots:  # conditional: the other slots held at the best set
        rival = (
            f"next best {e['next_best']} by {e['margin']:.4f} +- {e['margin_se']:.4f}" if e["next_best"] else "no rival"
        )
        lines.append(
            f"  slot {e['slot']}, the others as in the best set: {e['boundary']} ({rival})"
            f"{'' if e['conclusive'] else ', not settled'}"
        )
    if r.admissible and any(len(ks) > 1 for ks in r.admissible):
        feeds = ", ".join(f"slot {j} {' or '.join(ks)}" for j, ks in enumerate(r.admissible))
        lines.append(f"  what a deployment may feed, the tie left open: {feeds} (the gate accepts any of these)")
    if r.verdict != "inconclusive":
        for c in r.claimed_readings:
            if c["fit"] is None:
                continue
            mark = "= the inferred set" if c["is_the_inferred_set"] else "   a different set"
            lines.append(
                f"  {mark}: {', '.join(c['boundaries'])} (loss {-c['fit']:.4f}) read by "
                f"{'; '.join(c['read_by'][:3])}{' ...' if len(c['read_by']) > 3 else ''}"
            )
    if r.serving:
        if "not_compared" in r.serving:
            lines.append(f"  serving: not compared ({r.serving['not_compared']})")
        else:
            for s in r.serving["slots"]:
                trained = " or ".join(s["could_be"]) or s["trained"]
                lines.append(
                    f"  slot {s['slot']}: trained on {trained}, fed {s['fed']} ({s['fed_by']})"
                    f"{'' if s['ok'] else '  <-- wrong'}"
                )
            lines += [f"  - {x}" for x in r.reasons]
    lines += [f"  note: {x}" for x in r.notes]
    return lines

"""One regeneration worker: the target's own responses for a unit of conversations.

Turn by turn across the unit (every conversation's first assistant turn in one batch, then
every second one, ...): the prompt is the conversation so far -- earlier assistant turns
already the target's own -- in the target's chat template, and the original assistant turn
is replaced by what the target generates until its end of turn. A turn whose prompt exceeds
``max_length`` or whose response is empty ends its conversation there; a row that cannot be
parsed, or keeps no assistant turn, is quarantined with the reason. The unit's file is
written, then its commit record, both atomically.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from pipeline.data.chat import ChatEncoder
from pipeline.data.conversations import BadRow, parse_row
from pipeline.engines.generation import open_generator
from pipeline.identity import stop_token_ids
from pipeline.regenerate.layout import unit_paths
from pipeline.store.fs import atomic_write_bytes, join, resolve
from schemas.regenerate import RegenerateConfig, UnitRecord


def turn_seed(seed: int, row: int, turn: int) -> int:
    """A sampled turn's seed: fixed by the job's seed, the source row and the turn, so resuming
    or resharding cannot change a response."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()[:7], "little")


@dataclass
class _Conv:
    row: int
    todo: list[dict]
    done: list[dict] = field(default_factory=list)
    turn: int = 0


class RegenerateWorker:
    def __init__(self, cfg_json: str):
        self.cfg = RegenerateConfig.model_validate_json(cfg_json)
        self.enc = ChatEncoder(self.cfg.target.path, max_length=1 << 30)  # lengths are checked per turn here
        self.stop = stop_token_ids(self.cfg.target.path)
        self.gen = open_generator(self.cfg.target.path, self.cfg.engine)
        self.fs, self.root = resolve(self.cfg.output.uri, self.cfg.s3)

    def engine_version(self) -> str:
        return self.gen.version

    def process(self, unit: int, start: int, rows: list[bytes]) -> str:
        cfg = self.cfg
        convs, quarantine = [], []
        for j, data in enumerate(rows):
            try:
                convs.append(_Conv(start + j, list(parse_row(data).messages)))
            except BadRow as e:
                quarantine.append({"row": start + j, "reason": str(e)})
        counts = {"turns": 0, "cut_turns": 0, "dropped_turns": 0, "generated_tokens": 0}
        while True:
            asks = []
            for c in convs:
                while c.todo and c.todo[0]["role"] != "assistant":
                    c.done.append(c.todo.pop(0))
                if not c.todo:
                    continue
                prompt = self.enc.encode_prompt(c.done)
                if len(prompt) > cfg.max_length:
                    c.todo, counts["dropped_turns"] = [], counts["dropped_turns"] + 1
                    continue
                asks.append((c, prompt))
            if not asks:
                break
            seeds = [turn_seed(cfg.sampling.seed, c.row, c.turn) for c, _ in asks]
            outs = self.gen.generate([p for _, p in asks], cfg.max_new_tokens, cfg.sampling, seeds)
            for (c, _), toks in zip(asks, outs, strict=True):
                c.todo.pop(0)  # the original response
                c.turn += 1
                text = self.enc.decode_response(toks, self.stop)
                counts["generated_tokens"] += len(toks)
                if not text.strip():
                    c.todo, counts["dropped_turns"] = [], counts["dropped_turns"] + 1
                    continue
                counts["turns"] += 1
                counts["cut_turns"] += not (toks and toks[-1] in self.stop)
                c.done.append({"role": "assistant", "content": text})
        lines = []
        for c in convs:
            if not any(m["role"] == "assistant" for m in c.done):
                quarantine.append(
                    {
                        "row": c.row,
                        "reason": "no assistant turn survived regeneration (an empty "
                        "response, or a prompt over max_length)",
                    }
                )
                continue
            lines.append(json.dumps({"messages": c.done}, ensure_ascii=False) + "\n")
        blob = "".join(lines).encode()
        path, record_path = unit_paths(unit)
        atomic_write_bytes(self.fs, join(self.root, path), blob)
        rec = UnitRecord(
            unit=unit,
            start=start,
            rows=len(rows),
            written=len(lines),
            quarantined=len(quarantine),
            path=path,
            sha256=hashlib.sha256(blob).hexdigest(),
            quarantine=sorted(quarantine, key=lambda q: q["row"]),
            **counts,
        )
        atomic_write_bytes(self.fs, join(self.root, record_path), rec.model_dump_json().encode())
        return rec.model_dump_json()

    def close(self) -> None:
        self.gen.close()

"""Training-data fingerprints: what the draft was trained on, in a form small enough to
travel with every artifact, so a draft can be validated after its data is deleted.

Per probe sample and capture point: a seeded Gaussian random projection of each token's
vector to ``dim`` numbers (Johnson-Lindenstrauss: distances, hence relative L2 errors, are
preserved to ~1/sqrt(dim)), each token's RMS, and the SHA-256 of the raw tensor bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pipeline.store.fs import atomic_write_bytes, join, read_bytes, resolve
from pipeline.store.reader import index_samples

FINGERPRINTS_FILE = "fingerprints.safetensors"


def safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file held in memory (8-byte length, JSON header)."""
    import json

    header = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + header]).get("__metadata__", {})


def projection(hidden: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + hidden)
    return torch.randn(hidden, dim, generator=g) / dim**0.5


def sketch(x: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> ([T, dim] projection, [T] RMS), both float32."""
    x32 = x.float()
    return x32 @ proj.to(x32.device), x32.pow(2).mean(-1).sqrt()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, over every token (a is compared against reference b)."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def tensor_digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def probe_ids(sample_ids: list[str], n: int) -> list[str]:
    """The n samples with the smallest hash of their id: stable under resharding and resume.

    Training always holds these samples out (``train.data.split_eval``): acceptance is
    measured on prefixes of them, prompts the draft never saw.
    """
    return sorted(sample_ids, key=lambda s: hashlib.sha256(s.encode()).hexdigest())[:n]


@dataclass
class Fingerprints:
    sample_ids: list[str]
    lengths: list[int]
    points: list[str]
    dim: int
    seed: int
    sketches: dict[str, torch.Tensor]  # point -> [sum T, dim]
    rms: dict[str, torch.Tensor]  # point -> [sum T]
    digests: dict[str, list[str]]  # point -> sha256 of each sample's raw tensor
    input_ids: torch.Tensor  # [sum T] the probe samples' tokens, for replay
    # per probe sample, where its first assistant turn starts (None: not known, e.g. older datasets)
    prompt_lengths: list[int | None] | None = None

    def sample(self, point: str, i: int) -> torch.Tensor:
        off = sum(self.lengths[:i])
        return self.sketches[point][off : off + self.lengths[i]]

    def tokens(self, i: int) -> list[int]:
        off = sum(self.lengths[:i])
        return self.input_ids[off : off + self.lengths[i]].tolist()

    def prompts(self, n: int) -> list[list[int]]:
        """Acceptance prompts (``pipeline.acceptance``): the first ``n`` probe samples up to the
        start of their first assistant turn -- what a deployment is asked -- which training holds
        out (``train.data.split_eval``), so the draft never saw them. A sample whose turn start is
        not known is cut at half its length (at most 48 tokens)."""
        out = []
        for i in range(min(n, len(self.sample_ids))):
            toks = self.tokens(i)
            start = self.prompt_lengths[i] if self.prompt_lengths else None
            out.append(toks[:start] if start else toks[: max(4, min(48, len(toks) // 2))])
        return out

    def metadata(self) -> dict[str, str]:
        import json

        return {
            "sample_ids": json.dumps(self.sample_ids),
            "lengths": json.dumps(self.lengths),
            "points": json.dumps(self.points),
            "dim": str(self.dim),
            "seed": str(self.seed),
            "digests": json.dumps(self.digests),
            "prompt_lengths": json.dumps(self.prompt_lengths),
        }

    def save(self, uri: str, s3=None, name: str = FINGERPRINTS_FILE) -> tuple[str, str]:
        """Write to ``<uri>/<name>``; returns (relative path, sha256)."""
        tensors = {"input_ids": self.input_ids}
        for p in self.points:
            tensors[f"sketch/{p}"] = self.sketches[p].contiguous()
            tensors[f"rms/{p}"] = self.rms[p].contiguous()
        blob = st_save(tensors, metadata=self.metadata())
        fs, root = resolve(uri, s3)
        atomic_write_bytes(fs, join(root, name), blob)
        return name, hashlib.sha256(blob).hexdigest()

    @classmethod
    def load(cls, uri: str, s3=None, name: str = FINGERPRINTS_FILE) -> Fingerprints:
        import json

        fs, root = resolve(uri, s3)
        blob = read_bytes(fs, join(root, name))
        meta, t = safetensors_metadata(blob), st_load(blob)
        points = json.loads(meta["points"])
        return cls(
            sample_ids=json.loads(meta["sample_ids"]),
            lengths=json.loads(meta["lengths"]),
            points=points,
            dim=int(meta["dim"]),
            seed=int(meta["seed"]),
            sketches={p: t[f"sketch/{p}"] for p in points},
            rms={p: t[f"rms/{p}"] for p in points},
            digests=json.loads(meta["digests"]),
            input_ids=t["input_ids"],
            prompt_lengths=json.loads(meta.get("prompt_lengths", "null")),
        )


def from_samples(
    samples: Iterable[tuple[str, torch.Tensor, dict[str, torch.Tensor], int | None]],
    points: list[str],
    dim: int = 64,
    seed: int = 0,
    order: list[str] | None = None,
) -> Fingerprints:
    """Fingerprints of (sample id, token ids [T], point -> [T, H], first assistant token or None)
    samples, consumed one at a time; stored in ``order`` of sample ids when given (samples may
    then arrive in any order, e.g. as their row groups are read)."""
    projs: dict[int, torch.Tensor] = {}
    per_sample = []  # (sid, toks, start, {point: (sketch, rms, digest)}): small, unlike the states
    for sid, toks, tensors, start in samples:
        sketched = {}
        for p in points:
            x = tensors[p]
            if x.shape[-1] not in projs:
                projs[x.shape[-1]] = projection(x.shape[-1], dim, seed)
            sketched[p] = (*sketch(x, projs[x.shape[-1]]), tensor_digest(x))
        per_sample.append((sid, toks, start, sketched))
    if order is not None:
        rank = {sid: i for i, sid in enumerate(order)}
        per_sample.sort(key=lambda e: rank[e[0]])
    sids = [e[0] for e in per_sample]
    ids = [e[1] for e in per_sample]
    lengths = [int(t.numel()) for t in ids]
    starts = [e[2] for e in per_sample]
    sk = {p: [e[3][p][0] for e in per_sample] for p in points}
    rm = {p: [e[3][p][1] for e in per_sample] for p in points}
    dg = {p: [e[3][p][2] for e in per_sample] for p in points}
    return Fingerprints(
        sample_ids=sids,
        lengths=lengths,
        points=points,
        dim=dim,
        seed=seed,
        sketches={p: torch.cat(v) if v else torch.zeros(0, dim) for p, v in sk.items()},
        rms={p: torch.cat(v) if v else torch.zeros(0) for p, v in rm.items()},
        digests=dg,
        input_ids=torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long),
        prompt_lengths=starts if any(x is not None for x in starts) else None,
    )


def first_assistant_token(loss_mask) -> int | None:
    """Where a sample's first assistant turn starts: its first trained token (None if none)."""
    hits = torch.as_tensor(loss_mask).nonzero()
    return int(hits[0]) if hits.numel() else None


def compute(reader, n_probe: int, dim: int = 64, seed: int = 0) -> Fingerprints:
    """Fingerprints of ``n_probe`` samples of a dataset, from the stored (trained-on) values."""
    refs = {r.sample_id: r for r in index_samples(reader)}
    points = list(reader.points)

    probes = probe_ids(list(refs), n_probe)
    by_group: dict[tuple[str, int], list[str]] = {}
    for sid in probes:
        by_group.setdefault((refs[sid].shard, refs[sid].row_group), []).append(sid)

    def samples():
        for (shard, row_group), sids in by_group.items():  # each row group read once, not once per probe
            table = reader.read_row_group(shard, row_group)
            for sid in sids:
                i = refs[sid].row
                toks = torch.from_numpy(table["input_ids"][i].values.to_numpy().astype("int64"))
                mask = table["loss_mask"][i].values.to_numpy().astype(bool)
                yield sid, toks, {p: reader.decode(table, i, p) for p in points}, first_assistant_token(mask)

    return from_samples(samples(), points, dim, seed, order=probes)

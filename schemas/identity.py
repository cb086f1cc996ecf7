"""Target identity: which exact model produced a tensor.

Paths and names are informative only; two identities are the same target when their
content digests agree (weights, config, tokenizer, chat template).
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict


class FileDigest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    size: int
    sha256: str


def combine_digests(files: list[FileDigest]) -> str:
    """One digest over a file set, independent of listing order."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        h.update(f"{f.name}\0{f.size}\0{f.sha256}\n".encode())
    return h.hexdigest()


class TargetIdentity(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str
    model_path: str
    revision: str | None = None
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    weights: list[FileDigest]
    weights_sha256: str
    config_sha256: str
    tokenizer: list[FileDigest]
    tokenizer_sha256: str
    chat_template_sha256: str | None = None

    _DIGEST_FIELDS = ("weights_sha256", "config_sha256", "tokenizer_sha256", "chat_template_sha256")

    @property
    def key(self) -> str:
        """Short content key: equal keys mean the same weights, config, tokenizer, template."""
        payload = json.dumps({f: getattr(self, f) for f in self._DIGEST_FIELDS}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def differences(self, other: TargetIdentity) -> list[str]:
        """Human-readable list of what differs in content (empty when the same target)."""
        out = []
        for f in self._DIGEST_FIELDS:
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                out.append(f"{f.removesuffix('_sha256')}: {str(a)[:12]} vs {str(b)[:12]}")
        for f in ("num_layers", "hidden_size", "vocab_size"):
            if getattr(self, f) != getattr(other, f):
                out.append(f"{f}: {getattr(self, f)} vs {getattr(other, f)}")
        return out

    def describe(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.model_name}{rev} (key {self.key}, {self.num_layers} layers, H={self.hidden_size})"

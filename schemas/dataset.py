"""Arrow schema of the hidden-state dataset, and the tensor encoding, documented here.

One Parquet row per sample (sequence). Bookkeeping columns:

    sample_id      string   deterministic: sha256(source uri, row index, content digest)[:20]
    source_uri     string   where the conversation came from
    source_row     int64    0-based row (line) index in the source
    content_sha256 string   digest of the source row's canonical JSON
    input_ids      list<int32>
    loss_mask      list<uint8>   1 = assistant token (trained on), 0 = prompt/template
    num_tokens     int32

Tensor columns: one column group per capture point, a column per byte of the element.
"""

from __future__ import annotations

import json

import pyarrow as pa

from schemas.capture import CapturePoint
from schemas.provenance import DTYPE_BYTES, TensorProvenance

FORMAT_VERSION = 1
ENCODING = "byte_planes_v1"

ENCODING_DOC = """\
byte_planes_v1 -- how a tensor of one sample is stored.

A captured tensor for one sample has shape [T, H] (T = num_tokens, H = hidden_size) and a
dtype of B bytes per element (bfloat16/float16: B=2, float32: B=4), little-endian. It is
stored as B columns named "<capture point>#b<k>", k = 0..B-1, where column #b<k> holds byte
k of every element (k = B-1 is the most significant byte: sign and exponent), token-major:
byte k of element [t, h] is at offset t*H + h of the cell. Each cell is a large_binary value.
Each sample (row) is a row group of its own, so reading one sample reads only its bytes.

  * #b<B-1> (sign + exponent byte) is one standard zstd frame; decompress it to T*H bytes.
  * every other #b<k> is stored raw: exactly T*H bytes (mantissa bytes do not compress).

Field metadata "strata.codec" says "zstd" or "raw" per column; "strata.provenance" holds
the JSON provenance (capture point, dtype, engine and its native id, target identity key).

Decoding with pyarrow + numpy only:

    import numpy as np, pyarrow as pa, pyarrow.parquet as pq
    t = pq.read_table(path)                     # or pq.ParquetFile(path).read_row_group(i)
    T, H, B = t["num_tokens"][i].as_py(), hidden_size, 2
    planes = []
    for k in range(B):
        col = t[f"layer_output:1#b{k}"]
        cell = col[i].as_buffer()
        if col.field.metadata[b"strata.codec"] == b"zstd":   # or t.schema.field(...)
            cell = pa.decompress(cell, decompressed_size=T * H, codec="zstd")
        planes.append(np.frombuffer(cell, np.uint8).reshape(T, H))
    bits = np.stack(planes, axis=-1).view("<u2")[..., 0]      # "<u4" for float32
    # bfloat16 -> float32 exactly: (bits.astype(np.uint32) << 16).view(np.float32)
"""

META_PROVENANCE = b"strata.provenance"
META_CODEC = b"strata.codec"
META_BYTE = b"strata.byte"
META_TARGET = b"strata.target"
META_EXTRACTION = b"strata.extraction"
META_SOFTWARE = b"strata.software"
META_ENCODING_DOC = b"strata.encoding_doc"
META_FORMAT = b"strata.format_version"

BOOKKEEPING_FIELDS: list[pa.Field] = [
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("source_uri", pa.string(), nullable=False),
    pa.field("source_row", pa.int64(), nullable=False),
    pa.field("content_sha256", pa.string(), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
    pa.field("num_tokens", pa.int32(), nullable=False),
]


def plane_column(point: CapturePoint | str, k: int) -> str:
    """The one spelling of a byte plane's column name (readers and writers both use it)."""
    return f"{point}#b{k}"


def plane_codec(k: int, num_bytes: int) -> str:
    return "zstd" if k == num_bytes - 1 else "raw"


def tensor_fields(prov: TensorProvenance) -> list[pa.Field]:
    """The column group of one capture point, each field carrying the full provenance."""
    b = DTYPE_BYTES[prov.dtype]
    meta_common = {META_PROVENANCE: prov.model_dump_json().encode()}
    return [
        pa.field(
            plane_column(prov.capture_point, k),
            pa.large_binary(),
            nullable=False,
            metadata={**meta_common, META_BYTE: str(k).encode(), META_CODEC: plane_codec(k, b).encode()},
        )
        for k in range(b)
    ]


def dataset_schema(
    provenances: list[TensorProvenance],
    target_json: str,
    extraction_json: str,
    software: dict[str, str],
) -> pa.Schema:
    fields = list(BOOKKEEPING_FIELDS)
    for prov in provenances:
        fields.extend(tensor_fields(prov))
    return pa.schema(
        fields,
        metadata={
            META_FORMAT: str(FORMAT_VERSION).encode(),
            META_TARGET: target_json.encode(),
            META_EXTRACTION: extraction_json.encode(),
            META_SOFTWARE: json.dumps(software, sort_keys=True).encode(),
            META_ENCODING_DOC: ENCODING_DOC.encode(),
        },
    )


def provenances_from_schema(schema: pa.Schema) -> list[TensorProvenance]:
    """Provenance per capture point, in column order, read back from field metadata."""
    out: dict[str, TensorProvenance] = {}
    for f in schema:
        if f.metadata and META_PROVENANCE in f.metadata:
            prov = TensorProvenance.model_validate_json(f.metadata[META_PROVENANCE])
            out.setdefault(str(prov.capture_point), prov)
    return list(out.values())

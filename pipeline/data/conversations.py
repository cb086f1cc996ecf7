"""Validate and normalise one raw conversation row (OpenAI ``messages`` or ShareGPT)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "system": "system",
}


UNREADABLE = "_strata_unreadable"  # set by the Parquet reader for a row it could not turn into JSON


class BadRow(ValueError):
    """A row that cannot become a training sample; the message is the quarantine reason."""


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]  # [{"role": user|assistant|system, "content": str}, ...]
    content_sha256: str  # digest of the row's canonical JSON


def content_digest(obj: object) -> str:
    canon = json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    try:
        return hashlib.sha256(canon.encode()).hexdigest()
    except UnicodeEncodeError as e:  # a lone surrogate escape such as "\ud800": not Unicode text
        raise BadRow(
            f"text contains {canon[e.start : e.end].encode('unicode_escape').decode()}, a lone surrogate "
            "that is not valid Unicode"
        ) from None


def row_digest(data: bytes) -> str:
    """A source row's identity, for extraction and retraining alike: the digest of its canonical
    JSON, so a line written again by another serialiser (key order, spacing, escapes) is the same
    row; a line that is not JSON text is its bytes."""
    try:
        return content_digest(json.loads(data))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, BadRow):
        return hashlib.sha256(data).hexdigest()


def parse_row(data: bytes) -> Conversation:
    """Parse one row or raise BadRow with the reason it goes to quarantine."""
    if not data.strip():
        raise BadRow("empty line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRow(f"invalid UTF-8 at byte {e.start}: {e.reason}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRow(f"malformed JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise BadRow("JSON nested deeper than the parser's recursion limit") from None
    if not isinstance(obj, dict):
        raise BadRow(f"expected a JSON object, got {type(obj).__name__}")
    if UNREADABLE in obj:
        raise BadRow(obj[UNREADABLE])
    if "messages" in obj and obj["messages"] is not None:
        turns, role_key, content_key = obj["messages"], "role", "content"
    elif "conversations" in obj and obj["conversations"] is not None:
        turns, role_key, content_key = obj["conversations"], "from", "value"
    else:
        raise BadRow("no 'messages' (OpenAI) or 'conversations' (ShareGPT) field")
    if not isinstance(turns, list) or not turns:
        raise BadRow("conversation is not a non-empty list of turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow(f"turn {i} is not an object")
        raw_role = turn.get(role_key)
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise BadRow(f"turn {i}: unknown role {raw_role!r} (known: {sorted(ROLE_ALIASES)})")
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise BadRow(f"turn {i}: content is {type(content).__name__}, expected a string")
        if not content.strip():
            raise BadRow(f"turn {i}: empty content")
        if not content.isascii():
            try:
                content.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadRow(
                    f"turn {i}: content contains {content[e.start : e.end].encode('unicode_escape').decode()}, "
                    "a lone surrogate that is not valid Unicode"
                ) from None
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn: nothing to train on")
    return Conversation(messages=messages, content_sha256=content_digest(obj))

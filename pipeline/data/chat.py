"""Apply the target's chat template and mark assistant tokens (the loss mask).

The mask comes from the template's own rendering: for assistant turn i, the text the
template adds between ``render(messages[:i], add_generation_prompt=True)`` and
``render(messages[:i+1])`` is what the model generates (content + end-of-turn marker).
Tokens whose first character falls in such a span get mask 1.

Message content is text, never markup: a control-token string inside content (``<|start|>``,
``<|end|>``, ...) is tokenized as the characters it is made of, so a row cannot inject a
fake turn into the training data. Only the template's own markup becomes control tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.data.conversations import BadRow


class TemplateError(ValueError):
    """The chat template does not render conversations as growing prefixes."""


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]


class ChatEncoder:
    def __init__(self, model_dir: str | Path, max_length: int, length_policy: str = "truncate"):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        if not getattr(self.tokenizer, "is_fast", False):
            raise TemplateError(f"{model_dir}: a fast tokenizer (tokenizer.json) is needed for offset mapping")
        if not self.tokenizer.chat_template:
            raise TemplateError(f"{model_dir}: the tokenizer has no chat template")
        self.max_length = max_length
        self.length_policy = length_policy
        self.control = [t.content for t in self.tokenizer.added_tokens_decoder.values() if t.content]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(prompt) and full.startswith(upto)):
                raise TemplateError(
                    f"chat template does not render turn {i} as a prefix of the full conversation; "
                    "the loss mask cannot be derived from it"
                )
            spans.append((len(prompt), len(upto)))
        return full, spans

    def _content_spans(self, text: str, messages: list[dict]) -> list[tuple[int, int]]:
        """Where each content holding a control-token string sits in the rendered text."""
        spans, pos = [], 0
        for i, m in enumerate(messages):
            at = text.find(m["content"], pos)
            if at < 0:
                if any(c in m["content"] for c in self.control):
                    raise BadRow(
                        f"turn {i}: content holds control-token text and the chat template rewrites it, so "
                        "it cannot be kept as plain text"
                    )
                continue
            pos = at + len(m["content"])
            if any(c in m["content"] for c in self.control):
                spans.append((at, pos))
        return spans

    def _tokenize(self, text: str, messages: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character offsets; content with control-token strings is split as text."""
        pieces, last = [], 0
        for a, b in self._content_spans(text, messages):
            pieces += [(last, a, False), (a, b, True)]
            last = b
        pieces.append((last, len(text), False))
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for a, b, as_text in pieces:
            if a == b:
                continue
            enc = self.tokenizer(
                text[a:b], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=as_text
            )
            ids += enc["input_ids"]
            offsets += [(x + a, y + a) for x, y in enc["offset_mapping"]]
        return ids, offsets

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` followed by the template's generation prompt: what the target
        is asked to continue for the next assistant turn."""
        return self._tokenize(self.render(messages, add_generation_prompt=True), messages)[0]

    def decode_response(self, tokens: list[int], stop_ids: frozenset[int]) -> str:
        """A generated turn as message content: up to the end-of-turn token, control tokens dropped
        (content is text; the template adds the markup)."""
        end = next((i for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
        return self.tokenizer.decode(tokens[:end], skip_special_tokens=True)

    def encode(self, messages: list[dict]) -> Encoded:
        text, spans = self.assistant_spans(messages)
        ids, offsets = self._tokenize(text, messages)
        mask = [0] * len(ids)
        j = 0
        for t, (start, _end) in enumerate(offsets):
            while j < len(spans) and start >= spans[j][1]:
                j += 1
            if j < len(spans) and spans[j][0] <= start < spans[j][1]:
                mask[t] = 1
        if len(ids) > self.max_length:
            if self.length_policy == "drop":
                raise BadRow(f"over-length: {len(ids)} tokens > max_length {self.max_length} (length_policy=drop)")
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not any(mask):
            raise BadRow(f"no assistant tokens within the first {self.max_length} tokens")
        return Encoded(ids, mask)

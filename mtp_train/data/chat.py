"""Conversations → token ids + assistant-only loss masks, read off the target's own chat template.

Two ways to find the assistant tokens, both from the template itself (never by matching the rendered
string):
* templates with `{% generation %}` markers: transformers' `return_assistant_tokens_mask`;
* any other template: render the prefix before each assistant turn (with the generation prompt) and the
  prefix through it; the tokens in between are that turn's. The template must render prefixes as
  prefixes of the whole conversation, which is checked for every turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


class BadRecord(ValueError):
    """One input record that cannot become a sample; `kind` is counted in the manifest."""

    def __init__(self, kind: str, where: str, detail: str):
        super().__init__(f"{where}: {detail}")
        self.kind, self.where, self.detail = kind, where, detail


def _content(value, where: str, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if parts and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise BadRecord("missing_field", where, f"field {field!r} must be a string (or a list of text parts)")


def normalize(record, fmt: str, where: str, need_assistant: bool = True) -> list[dict[str, str]]:
    """A ShareGPT (`conversations: [{from, value}]`) or OpenAI (`messages: [{role, content}]`) record as a
    list of `{role, content}` with roles system/user/assistant (with an assistant turn unless
    `need_assistant=False`: a prompt)."""
    key, role_key, text_key = ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    if not isinstance(record, dict):
        raise BadRecord("missing_field", where, f"expected a JSON object with field {key!r}")
    turns = record.get(key)
    if turns is None:
        raise BadRecord("missing_field", where, f"missing field {key!r}")
    if not isinstance(turns, list):
        raise BadRecord("missing_field", where, f"field {key!r} must be a list")
    if not turns:
        raise BadRecord("empty_conversation", where, f"field {key!r} is empty")
    messages = []
    for i, turn in enumerate(turns):
        field = f"{key}[{i}]"
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRecord("missing_field", where, f"{field} needs fields {role_key!r} and {text_key!r}")
        raw_role = turn[role_key]
        role = SHAREGPT_ROLES.get(raw_role) if fmt == "sharegpt" else (raw_role if raw_role in ROLES else None)
        if role is None:
            allowed = ", ".join(SHAREGPT_ROLES if fmt == "sharegpt" else ROLES)
            raise BadRecord("unknown_role", where, f"{field}.{role_key} is {raw_role!r}; expected one of {allowed}")
        messages.append({"role": role, "content": _content(turn[text_key], where, f"{field}.{text_key}")})
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant_turn", where, "the conversation has no assistant turn")
    return messages


def has_generation_markers(tokenizer) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", tokenizer.chat_template or "") is not None


def _last_run(mask: list[int]) -> list[int]:
    """Only the last contiguous run of ones (the last assistant turn)."""
    end = max((i for i, m in enumerate(mask) if m), default=-1) + 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [int(start <= i < end) for i in range(len(mask))]


def _render(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], last_turn_only: bool = False,
                          where: str = "") -> Tokenized:
    """Token ids of the conversation as the template renders it, and a mask that is 1 exactly on the
    assistant turns (all of them, or the last one)."""
    if not tokenizer.chat_template:
        raise ValueError("the target's tokenizer has no chat template: conversations cannot be tokenized "
                         "(use plain-text sources, or add a chat template to the tokenizer)")
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        mask = [int(m) for m in out["assistant_masks"]]
        return Tokenized(list(out["input_ids"]), _last_run(mask) if last_turn_only else mask)
    # Without markers: the text between the prefix before an assistant turn (with the generation prompt)
    # and the prefix through it is that turn. Token ids come from one tokenization of the whole
    # conversation (exactly what apply_chat_template gives), and each token is assigned by its characters,
    # so BPE merges across the boundary cannot shift the mask. What a template writes after the turn's
    # last special token (the newline after ChatML's <|im_end|>) is scaffolding, not the turn.
    text = _render(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in turns[-1:] if last_turn_only else turns:
        start = _render(tokenizer, messages[:i], add_generation_prompt=True)
        end = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(end) and end.startswith(start)):
            raise ValueError(f"{where}: the chat template does not render conversation prefixes as prefixes "
                             "of the whole conversation, so assistant tokens cannot be located; use a template "
                             "with {% generation %} markers")
        spans.append((len(start), len(end)))
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    mask = [0] * len(ids)
    for s, e in spans:
        turn = [k for k, (a, b) in enumerate(offsets) if a < e and b > s]
        ends = [k for k in turn if ids[k] in special]
        for k in turn if not ends else [k for k in turn if k <= ends[-1]]:
            mask[k] = 1
    return Tokenized(ids, mask)


def tokenize_text(tokenizer, text: str, max_length: int) -> list[Tokenized]:
    """A document cut into chunks of at most `max_length` tokens, every token trainable."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return [Tokenized(ids[i : i + max_length], [1] * len(ids[i : i + max_length]))
            for i in range(0, len(ids), max_length) if len(ids[i : i + max_length]) > 1]

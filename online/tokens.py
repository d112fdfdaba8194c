"""Prompt lengths and output text for the online server.

A prompt's length comes from a tokenizer when ``serve.tokenizer`` names a local one (a folder
or a model id already in the local Hugging Face cache, loaded with ``transformers`` and never
downloaded), or else when the model's own (``model.hf_name``) is in the local cache; without
one it is an estimate: one token per 4 bytes of UTF-8 text, rounded up
(the usual rule of thumb for English with BPE tokenizers), and for chat 4 tokens more per
message and 3 for the reply's header (the formatting OpenAI documents for its chat models).
A prompt sent as token ids is counted exactly.

The output of the cost model is filler, one word per token; that of the real executor is its
sampled token ids, decoded by the tokenizer where there is one, else written as `` <id>``.
"""

from __future__ import annotations

import math
import os
from typing import Any

from sim.errors import ConfigError

BYTES_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_REPLY_TOKENS = 3
FILLER = (" the", " of", " and", " to", " a", " in", " is", " it", " that", " for", " on",
          " was", " with", " as", " at", " by", " this", " from", " or", " an")


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN)


def _content_text(content: Any) -> str:
    """A chat message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


class PromptCounter:
    """Counts prompt tokens (``count_text``, ``count_chat``: the length and the token ids,
    real or stand-in) and writes output tokens as text (``text``)."""

    def __init__(self, tokenizer: str | None = None, *, vocab_size: int = 32000,
                 model_tokenizer: str = "") -> None:
        """``tokenizer``: a local tokenizer to load (an error if it cannot be); else
        ``model_tokenizer`` (the model's Hugging Face name) if it is in the local cache and
        ``transformers`` is installed; else the estimate. ``source`` says which."""
        self.vocab_size = vocab_size
        self.tokenizer = None
        self.source = f"estimate ({BYTES_PER_TOKEN} bytes of text per token)"
        if tokenizer is not None:
            self.tokenizer = load_tokenizer(tokenizer)
            self.source = f"tokenizer {tokenizer}"
        elif model_tokenizer:
            try:
                self.tokenizer = load_tokenizer(model_tokenizer)
                self.source = f"tokenizer {model_tokenizer} (local cache)"
            except ConfigError:  # not here: the estimate
                pass

    def count_text(self, text: str) -> tuple[int, list[int]]:
        if self.tokenizer is not None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=True))
            return len(ids), self._fit(ids)
        n = estimate_tokens(text)
        return n, self._stand_in_ids(text, n)

    def count_ids(self, ids: list[int]) -> tuple[int, list[int]]:
        """A prompt sent as token ids: counted exactly."""
        return len(ids), self._fit(ids)

    def count_chat(self, messages: list[dict[str, Any]]) -> tuple[int, list[int]]:
        tok = self.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": m["role"], "content": _content_text(m.get("content"))}
                 for m in messages], tokenize=True, add_generation_prompt=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            return len(ids), self._fit(ids)
        if tok is not None:  # no template: the messages' tokens, formatted as estimated
            ids = [t for m in messages
                   for t in tok.encode(_content_text(m.get("content")), add_special_tokens=False)]
            n = len(ids) + CHAT_TOKENS_PER_MESSAGE * len(messages) + CHAT_REPLY_TOKENS
            return n, self._fit(ids + [0] * (n - len(ids)))
        text = "".join(f"{m['role']}\n{_content_text(m.get('content'))}" for m in messages)
        n = (sum(estimate_tokens(_content_text(m.get("content"))) for m in messages)
             + CHAT_TOKENS_PER_MESSAGE * len(messages) + CHAT_REPLY_TOKENS)
        return n, self._stand_in_ids(text, n)

    def text(self, index: int, token_id: int | None) -> str:
        """The text of output token ``index`` (0-based) whose id is ``token_id`` (None:
        the cost model samples none)."""
        if token_id is None:
            return FILLER[index % len(FILLER)]
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id])
        return f" <{token_id}>"

    def _fit(self, ids: list[int]) -> list[int]:
        """Token ids folded into the model's vocab (the tokenizer's may be larger)."""
        return [t % self.vocab_size for t in ids]

    def _stand_in_ids(self, text: str, n: int) -> list[int]:
        """Without a tokenizer: ``n`` ids made from the text's bytes (each 4-byte chunk read
        as a number in the vocab), padded with zeros. Equal texts get equal ids, and two
        prompts that start alike share their first ids (what the prefix cache keys on)."""
        raw = text.encode("utf-8")
        ids = [int.from_bytes(raw[i:i + BYTES_PER_TOKEN], "little") % self.vocab_size
               for i in range(0, len(raw), BYTES_PER_TOKEN)][:n]
        return ids + [0] * (n - len(ids))


def prefix_spans(ids: list[int], span: int = 16) -> tuple[tuple[int, int], ...]:
    """The prompt as content spans for the prefix cache (``Request.prefix``): one per
    ``span`` tokens, keyed by a hash of their ids, so prompts that agree on their first
    tokens share the keys of their common whole blocks (sim/prefix_cache.py)."""
    return tuple((hash(tuple(ids[i:i + span])), len(ids[i:i + span]))
                 for i in range(0, len(ids), span))


def load_tokenizer(name: str) -> Any:
    """A tokenizer from a local folder or the local Hugging Face cache (never downloaded)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("serve.tokenizer", "needs the transformers package "
                          "(pip install transformers)") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # what transformers raises for a bad one
        raise ConfigError("serve.tokenizer", f"no local tokenizer {name!r}: "
                          f"{str(e).splitlines()[0]}") from None

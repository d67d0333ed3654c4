"""Chat messages -> prompt text, with the model's own chat template when it has one.

A checkpoint's `tokenizer_config.json` may carry a Jinja `chat_template` (and the
`bos_token` / `eos_token` it refers to); it is rendered in a sandbox with the variables
transformers passes (`messages`, `add_generation_prompt`, special tokens, `raise_exception`).
Models without one, like the embedded code models, which were never tuned for chat, use
`PLAIN_TEMPLATE`: the message contents joined by newlines, which the model continues.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from failfast.errors import CheckpointError, GenerationInputError

PLAIN_TEMPLATE = "{{ messages | map(attribute='content') | join('\\n') }}"
ROLES = ("system", "user", "assistant", "developer", "tool")


def _token_text(value: Any) -> str:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _raise(message: str) -> None:
    raise GenerationInputError(f"the chat template refused the messages: {message}")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise CheckpointError(f"the chat template does not parse: {exc}") from None
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def for_model(cls, folder: Path) -> "ChatTemplate":
        """The template in `folder/tokenizer_config.json`, else the plain one."""
        path = Path(folder) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source:
            return cls(PLAIN_TEMPLATE)
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict[str, Any]]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except GenerationInputError:
            raise
        except TemplateError as exc:
            raise GenerationInputError(f"the chat template failed on these messages: {exc}") from None

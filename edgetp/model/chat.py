"""Chat templates: render a model's jinja2 `tokenizer.chat_template` the way
transformers' `apply_chat_template` does, or a plain ChatML text when the
model carries no template."""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template called raise_exception(), or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # transformers replaces jinja's tojson: no HTML escaping, unicode kept as is
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chatml(messages: list[dict], *, add_generation_prompt: bool = True) -> str:
    """ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then
    `<|im_start|>assistant\\n` when a reply is wanted."""
    parts = [f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_chat_template(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `template` with jinja2 in a sandbox, with the variables
    transformers passes (messages, add_generation_prompt, bos_token,
    eos_token, any extra such as tools) and its helpers raise_exception and
    strftime_now. A missing template falls back to `render_chatml`."""
    if not template:
        return render_chatml(messages, add_generation_prompt=add_generation_prompt)
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc

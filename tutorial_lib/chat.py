"""Chat templates: how a chat model lays a conversation out as one text.

A chat model was fine-tuned on conversations written in one fixed layout, for SmolLM2
``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``. Its files carry that layout as
a Jinja template (``chat_template`` in ``tokenizer_config.json``, ``tokenizer.chat_template``
in GGUF metadata); :func:`render_chat` renders it as ``transformers`` does and says where each
message's content lies in the result. Which parts become special-token ids is the tokenizer's
business (:meth:`tutorial_lib.bpe.BPETokenizer.apply_chat_template`: the template's markers,
never a message's content), which the spans make possible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Two private-use characters mark where each message's content lies in the rendered text.
_OPEN, _CLOSE = "\ue000", "\ue001"


def render_chat(template: str, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "") -> tuple[str, list[tuple[int, int]]]:
    """A chat template rendered with Jinja (sandboxed, with the options ``transformers`` uses),
    and the (start, end) character span of every message's content in the result."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {messages!r:.80}")
    marked = []
    for k, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"message {k} must be a dict with a 'role' and a 'content' string, got {message!r:.80}")
        if _OPEN in message["content"] or _CLOSE in message["content"]:
            raise ValueError(f"message {k} holds U+E000 or U+E001, which render_chat uses as markers")
        marked.append({**message, "content": _OPEN + message["content"] + _CLOSE})

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    try:
        rendered = env.from_string(template).render(messages=marked, add_generation_prompt=add_generation_prompt,
                                                    bos_token=bos_token, eos_token=eos_token)
    except TemplateError as err:
        raise ValueError(f"the chat template failed: {err}") from err
    text, spans, start = [], [], None
    length = 0
    for ch in rendered:
        if ch == _OPEN:
            start = length
        elif ch == _CLOSE:
            spans.append((start, length))
        else:
            text.append(ch)
            length += 1
    return "".join(text), spans

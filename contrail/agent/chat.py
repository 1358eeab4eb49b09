"""Rendering a growing conversation as token ids, append-only.

Multi-turn RL must train on exactly the ids that were sampled; decoding the
history and re-encoding it changes ids at turn boundaries (the most reported
multi-turn RL bug). So the conversation is only ever *extended*: the prompt is
rendered once, the sampled ids are appended as they are, and each observation
is appended as the ids of one user turn plus the generation prompt, cut from
the chat template's own rendering.

This requires an append-only template (rendering ``messages + [m]`` starts
with the rendering of ``messages``), which chatML, Llama-3 and Qwen templates
are. A template that is not append-only is rejected with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

_SENTINEL = "\u2063contrail-sentinel\u2063"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be extended append-only."""


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class ChatFormat:
    """Token pieces of one tokenizer's chat template.

    - ``prompt_ids(messages)``: the opening conversation plus the generation prompt.
    - ``assistant_close_ids``: what the template writes after an assistant's
      content (e.g. ``<|im_end|>\\n``); its first id is the stop token a model
      samples, the rest is appended without training on it.
    - ``user_turn_ids(text)``: one user turn followed by the generation prompt.
    """

    tokenizer: object
    assistant_close_ids: list[int]
    stop_ids: frozenset[int]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatFormat":
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("the tokenizer has no chat template; contrail needs an instruct/chat model")
        close_text = _assistant_close_text(tokenizer)
        close_ids = _encode(tokenizer, close_text) if close_text else []
        stops = {tokenizer.eos_token_id}
        if close_ids:
            stops.add(close_ids[0])
        return cls(tokenizer, close_ids, frozenset(i for i in stops if i is not None))

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return _encode(self.tokenizer, _render(self.tokenizer, messages, add_generation_prompt=True))

    def user_turn_ids(self, text: str) -> list[int]:
        return _encode(self.tokenizer, _user_turn_text(self.tokenizer, text))

    def close_after(self, generated: list[int]) -> list[int]:
        """Template ids to append after a turn's sampled ids.

        A turn that ended on the stop token needs only the rest of the closing
        (e.g. the newline after ``<|im_end|>``); a turn cut by the token limit
        needs all of it, so the next user turn starts on a well-formed boundary.
        """
        if generated and self.assistant_close_ids and generated[-1] == self.assistant_close_ids[0]:
            return self.assistant_close_ids[1:]
        if generated and generated[-1] in self.stop_ids:
            return []
        return list(self.assistant_close_ids)


def _assistant_close_text(tokenizer) -> str:
    """The text a template writes after an assistant message's content."""
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    rendered = _render(tokenizer, messages, add_generation_prompt=False)
    if _SENTINEL not in rendered:
        raise TemplateError("the chat template drops assistant content; cannot render multi-turn episodes")
    return rendered.split(_SENTINEL, 1)[1]


def _user_turn_text(tokenizer, text: str) -> str:
    """The text one user turn (plus generation prompt) appends to a conversation."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    before = _render(tokenizer, base, add_generation_prompt=False)
    after = _render(tokenizer, base + [{"role": "user", "content": text}], add_generation_prompt=True)
    if not after.startswith(before):
        raise TemplateError(
            "the chat template is not append-only (adding a turn rewrites earlier text); "
            "token-in/token-out rollouts need an append-only template such as chatML"
        )
    return after[len(before):]

"""Stop strings: generation ends at the first token after which the generated text contains a stop string.

`StopStrings` decodes the generated tokens (transformers' `StopStringCriteria` fails on tokenizers it cannot map back
to text), so it agrees with the text a trace records. Capture and replay (`Runtime.stops`) both use it and end a reply
at the same `end_ids`, where a server stops (vLLM: the generation config's ids).
"""

from __future__ import annotations

from collections.abc import Sequence

import jinja2
import torch
from transformers import StoppingCriteria

from kvprof.traces.chat import ChatFormat, Message

PROBE = "kvprof-probe-reply"  # an assistant message's content, to find what a template writes after it


class StopStrings(StoppingCriteria):
    """Stops at the token completing a stop string in the text generated after `prompt_length` (as
    `StopStringCriteria` where its text agrees, but never across the prompt's end)."""

    def __init__(self, tokenizer, stop: Sequence[str], prompt_length: int = 0):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.prompt_length = prompt_length

    def found(self, new_tokens: list[int]) -> bool:
        """Whether the decoded text of `new_tokens` (the generated tokens only) contains a stop string."""
        text = self.tokenizer.decode(new_tokens)
        return any(stop in text for stop in self.stop)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs) -> torch.Tensor:
        """transformers' stopping-criterion call: one flag per row of `input_ids` (prompt + generated tokens)."""
        done = [self.found(row[self.prompt_length :].tolist()) for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def end_of_turn(tokenizer, template: str) -> int | None:
    """The special token `template` closes an assistant message with (`<|eot_id|>`, `<|im_end|>`, …), or None."""
    try:
        text = ChatFormat(tokenizer, template).text([Message("user", "Hello."), Message("assistant", PROBE)])
    except jinja2.TemplateError:
        return None
    if PROBE not in text:
        return None
    special = set(tokenizer.all_special_ids)
    after = tokenizer.encode(text[text.index(PROBE) + len(PROBE) :], add_special_tokens=False)
    return next((token for token in after if token in special), None)


def end_ids(tokenizer, generation_config, template: str | None) -> list[int]:
    """The ids a reply ends at: tokenizer EOS, generation-config EOS ids, the template's end of turn, once each."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(generation_config, "eos_token_id", None)
    ids += configured if isinstance(configured, list) else [configured]
    if template is not None:
        ids.append(end_of_turn(tokenizer, template))
    return list(dict.fromkeys(token for token in ids if token is not None))

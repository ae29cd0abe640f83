"""Stop strings: generation ends at the first token after which the generated text contains a stop string.

transformers' own `StopStringCriteria` matches stop strings against a preprocessed vocabulary, which fails on
tokenizers it cannot map back to text (a byte-level BPE without a decoder, a vocabulary without the stop string's
characters). `StopStrings` instead decodes the generated tokens with the tokenizer, so it works with any tokenizer that
decodes (`kvprof.model.agents.load_tokenizer` refuses one that does not) and agrees with the text a trace records for
each output (`tokenizer.decode(tokens)`). Capture (transformers' `generate`) and replay (`Runtime.stops`, greedy
decoding) both use it, and both end a reply at the same ids (`end_ids`): the tokenizer's and the model's
end-of-sequence ids and, for calls rendered through a chat template, the token the template closes an assistant message
with — where a server stops generating (vLLM stops at the ids of the model's generation config, which list it for chat
models).
"""

from __future__ import annotations

from collections.abc import Sequence

import jinja2
import torch
from transformers import StoppingCriteria

from kvprof.traces.chat import ChatFormat, Message

PROBE = "kvprof-probe-reply"  # an assistant message's content, to find what a template writes after it


class StopStrings(StoppingCriteria):
    """Stops once the text of the tokens generated after the first `prompt_length` contains one of `stop`.

    Checked after every new token, it stops at the token that completes the first stop string: where the decoded
    text is the text transformers' `StopStringCriteria` reconstructs, the token that one stops at, except that a stop
    string is only found in the generated text, never across the prompt's end.
    """

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
    """The special token `template` closes an assistant message with (Llama 3's `<|eot_id|>`, Qwen's `<|im_end|>`,
    Gemma's `<end_of_turn>`, Mistral's `</s>`): the first special id of what it renders after a reply's content.
    None when it writes none there (kvprof's demo layout) or cannot render a user message and a reply."""
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
    """The ids a reply ends at (see the module docstring): the tokenizer's EOS, the generation config's EOS ids and
    the chat template's end-of-turn token, each once, in that order."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(generation_config, "eos_token_id", None)
    ids += configured if isinstance(configured, list) else [configured]
    if template is not None:
        ids.append(end_of_turn(tokenizer, template))
    return list(dict.fromkeys(token for token in ids if token is not None))

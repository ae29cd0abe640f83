"""Stop strings: generation ends at the first token after which the generated text contains a stop string.

transformers' own `StopStringCriteria` matches stop strings against a preprocessed vocabulary, which fails on
tokenizers it cannot map back to text (a byte-level BPE without a decoder, a vocabulary without the stop string's
characters). `StopStrings` instead decodes the generated tokens with the tokenizer, so it works with any tokenizer that
decodes (`kvprof.model.load_tokenizer` refuses one that does not) and agrees with the text a trace records for each
output (`tokenizer.decode(tokens)`). Capture (transformers' `generate`) and replay (`Runtime.stops`, greedy decoding)
both use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import StoppingCriteria


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

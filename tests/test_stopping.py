"""Stop strings found in the decoded generated text (`kvprof.traces.stopping`), with any tokenizer."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.stopping_criteria import StopStringCriteria

from kvprof.model.tiny import CORPUS, build_tokenizer
from kvprof.traces.stopping import StopStrings


def _first_stop(stops_after, prompt: list[int], generated: list[int]) -> int | None:
    """The index of the generated token after which `stops_after(sequence)` first holds, checked token by token."""
    for index in range(len(generated)):
        if stops_after(prompt + generated[: index + 1]):
            return index
    return None


@pytest.mark.parametrize("stop", [["\n"], ["]", "\n"], ["search[", "Obs"]])
def test_stops_at_the_token_transformers_stops_at(stop):
    """On a byte-level BPE with a decoder, the token after which generation stops is the one transformers'
    `StopStringCriteria` stops after, for single- and multi-character stop strings."""
    tokenizer = build_tokenizer()
    theirs = StopStringCriteria(tokenizer, stop)
    prompt = tokenizer.encode("Question: x\n", add_special_tokens=False)
    ours = StopStrings(tokenizer, stop, prompt_length=len(prompt))
    pieces = [tokenizer.encode(text, add_special_tokens=False) for text in [*stop, *CORPUS[1].split()]]
    rng = random.Random(0)
    stopped = 0
    for _ in range(200):
        generated: list[int] = []
        for _ in range(8):  # pieces of stop strings and words, and random tokens
            generated += rng.choice(pieces) if rng.random() < 0.3 else [rng.randrange(len(tokenizer))]
        expected = _first_stop(lambda ids: bool(theirs(torch.tensor([ids]), None)[0]), prompt, generated)
        assert _first_stop(lambda ids: bool(ours(torch.tensor([ids]), None)[0]), prompt, generated) == expected
        stopped += expected is not None
    assert stopped > 20  # the comparison covered many stops


def test_finds_stop_strings_without_a_decoder():
    """A byte-level BPE without a decoder decodes to its raw tokens, where the stop string is found as text."""
    tokenizer = build_tokenizer()
    tokenizer.backend_tokenizer.decoder = None
    stops = StopStrings(tokenizer, ["]"])
    assert not stops.found(tokenizer.encode("act: search", add_special_tokens=False))
    assert stops.found(tokenizer.encode("act: search[Kalomir]", add_special_tokens=False))

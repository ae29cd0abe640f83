"""The demo world's byte-level BPE tokenizer (`tokenizers`, saved for AutoTokenizer): any text encodes
losslessly; every name follows a space, so it is one token sequence wherever it occurs (2–4 tokens, mostly 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvprof.demo.world import PERSON_FINALS, PLACE_FINALS, ROLES, DemoTask, workflow_spec

EOS = "<eos>"
VOCAB_SIZE = 1024


def corpus(tasks: Iterable[DemoTask]) -> Iterator[str]:
    """Every text the runner tokenizes for these tasks in both modes, each on its own as the runner encodes it."""
    for mode in ("prompt", "lora"):
        spec = workflow_spec(mode)
        if spec.system_prompt:
            yield spec.system_prompt
        for agent in spec.agents:
            if agent.prompt:
                yield agent.prompt
    spec = workflow_spec("lora")
    for task in tasks:
        yield spec.question_template.format(question=task.task.question)
        for text in task.task.documents.values():
            yield spec.observation_template.format(observation=text)
        for role, observations in task.schedule():
            yield spec.cue_template.format(agent=role)
            yield from (task.output(any_role, observations) for any_role in ROLES)


def build_tokenizer(tasks: Iterable[DemoTask], vocab_size: int = VOCAB_SIZE):
    """Train the BPE on `corpus(tasks)`, names' finals split off first (see module docstring)."""
    from tokenizers import Regex, pre_tokenizers

    finals = Regex("|".join(sorted(PERSON_FINALS + PLACE_FINALS, key=len, reverse=True)))
    return train_bpe(corpus(tasks), vocab_size, [pre_tokenizers.Split(finals, behavior="isolated")])


def train_bpe(texts: Iterable[str], vocab_size: int, split: list | None = None, max_length: int = 32768):
    """Byte-level BPE on `texts` (after the `split` pre-tokenizers), as a `PreTrainedTokenizerFast` (EOS pads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([*(split or []), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )

"""Where the shipped demo world lives: `demo_world()` returns the paths other commands use as their defaults.

The assets (written by `python -m kvprof.demo.train` and `python -m kvprof.demo.traces`) ship inside the package::

    assets/model/                      base model + tokenizer (transformers format, safetensors)
    assets/adapters/lora/{plan,act,reflect}/        r=8 LoRA on q/k/v/o (the primary adapters)
    assets/adapters/shared_a/{plan,act,reflect}/    r=8 LoRA on q/k/v/o sharing one A (BaseLRShared)
    assets/adapters/{lora_qv,shared_a_qv}/…         r=8, α=16 on q/v only (the papers'); A shared on v_proj
    assets/workflow_{prompt,lora,lora_shared_a,lora_qv,lora_shared_a_qv}.toml
    assets/tasks/{heldout,long}.jsonl
    assets/sample_traces/{prompt,lora}_{short,long}.jsonl, prompt_tune.jsonl (fit-anchors / tune-tau)
    assets/chat_template.jinja         the prompt-mode layout as a chat template (`kvprof capture/import-chat`)
    assets/sample_logs/prompt_short_chat.jsonl     prompt_short's calls as a chat log (`kvprof import-chat`)
    assets/sample_logs/prompt_short_group_chat.jsonl  the same calls as a group chat logs them
    assets/sample_logs/prompt_short_otlp.json       the same calls as an OTLP export (GenAI conventions)
    assets/training.json, assets/evaluation.json    what training and evaluation measured
    assets/codebook/                   the codebook world (`kvprof.demo.codebook_world`): prompt-role agents whose
                                       private keys change what the shared tokens mean

Paths inside sample traces and workflow files are relative to the assets folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvprof.demo.world import ROLES
from kvprof.errors import KvprofError

ASSETS = Path(__file__).parent / "assets"
TRACE_NAMES = ("prompt_short", "lora_short", "prompt_long", "lora_long", "prompt_tune")


@dataclass(frozen=True)
class WorldFolder:
    """What every trained world's folder holds: the model, held-out and long tasks, the evaluation record."""

    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def heldout_tasks(self) -> Path:
        return self.root / "tasks" / "heldout.jsonl"

    @property
    def long_tasks(self) -> Path:
        return self.root / "tasks" / "long.jsonl"

    @property
    def evaluation_record(self) -> Path:
        return self.root / "evaluation.json"

    def require(self, name: str, files: list[Path], rebuild: str) -> None:
        """Refuse a folder that lacks one of `files`, naming the first missing one and the command `rebuild`."""
        missing = [path for path in files if not path.exists()]
        if missing:
            raise KvprofError(f"the {name} at {self.root} is incomplete ({missing[0]} is missing); {rebuild}.")


@dataclass(frozen=True)
class DemoWorld(WorldFolder):
    """Paths of one demo world (see module docstring)."""

    @property
    def adapters(self) -> dict[str, Path]:
        """Role → primary adapter directory (r=8 on q/k/v/o)."""
        return {role: self.root / "adapters" / "lora" / role for role in ROLES}

    @property
    def shared_a_adapters(self) -> dict[str, Path]:
        """Role → adapter directory of the set that shares one A per projection (only B differs)."""
        return {role: self.root / "adapters" / "shared_a" / role for role in ROLES}

    def workflow(self, mode: str) -> Path:
        """`prompt`, `lora`, `lora_shared_a`, `lora_qv`, `lora_shared_a_qv`, `alora` or `alora_qv`."""
        return self.root / f"workflow_{mode}.toml"

    @property
    def prompt_workflow(self) -> Path:
        return self.workflow("prompt")

    @property
    def lora_workflow(self) -> Path:
        return self.workflow("lora")

    @property
    def sample_traces(self) -> dict[str, Path]:
        """`prompt_short`, `lora_short` (a few held-out tasks), `prompt_long`, `lora_long` (a 3-hop task with
        several thousand tokens of shared context) and `prompt_tune` (more held-out tasks in prompt mode, for
        fit-anchors and tune-tau) → trace file."""
        return {name: self.root / "sample_traces" / f"{name}.jsonl" for name in TRACE_NAMES}

    @property
    def chat_template(self) -> Path:
        return self.root / "chat_template.jinja"

    @property
    def sample_chat_log(self) -> Path:
        """The held-out tasks of `prompt_short` as a chat log: one agent call per line, OpenAI message format."""
        return self.root / "sample_logs" / "prompt_short_chat.jsonl"

    @property
    def sample_group_chat_log(self) -> Path:
        """The same calls as a group chat logs them: other agents' replies as `user` messages with a `name`."""
        return self.root / "sample_logs" / "prompt_short_group_chat.jsonl"

    @property
    def sample_otlp_log(self) -> Path:
        """The same calls as an instrumented client exports them: OTLP JSON with the GenAI conventions."""
        return self.root / "sample_logs" / "prompt_short_otlp.json"


def demo_world(root: str | Path | None = None) -> DemoWorld:
    """The shipped demo world (or one written by `python -m kvprof.demo.train --out ROOT`); refuses a folder without
    the trained model."""
    world = DemoWorld(Path(root) if root is not None else ASSETS)
    world.require(
        "demo world",
        [
            world.model / "config.json",
            world.model / "tokenizer.json",
            world.lora_workflow,
            world.prompt_workflow,
            world.heldout_tasks,
            *world.adapters.values(),
        ],
        "reinstall kvprof or rebuild it with `python -m kvprof.demo.train --out DIR`",
    )
    return world

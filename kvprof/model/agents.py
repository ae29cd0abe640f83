"""Loading: the base model, its tokenizer, PEFT LoRA adapters, and the `AgentSet` that switches between agents.

An `AgentSet` holds one base model shared by every agent. In lora mode each agent is a named PEFT adapter on it
(`activate(name)` selects it); in prompt mode agents differ only by role prompt and the base runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvprof.errors import KvprofError
from kvprof.fileio import check_fields, read_json_file
from kvprof.model.architecture import attention_of, decoder_layers, recurrent_of
from kvprof.model.checks import (
    ADAPTER_FIX,
    MODEL_FIX,
    check_adapter_config,
    check_adapter_coverage,
    check_finite,
    check_loading_report,
    check_target_modules,
    check_tokenizer_files,
    check_weights_fit_config,
    checkpoint_shapes,
    read_model_config,
    reason_of,
    safetensors_shapes,
    safetensors_tensors,
)
from kvprof.model.first_layers import beyond_limit, first_layers_config, layer_limit, note_loaded, note_loading
from kvprof.model.latent import LatentShape, latent_layers
from kvprof.model.layers import LayerKind, cache_shapes, layer_kinds
from kvprof.model.lora import invocation_tokens
from kvprof.model.recurrent import recurrent_layers
from kvprof.model.rope import LayerRopes, model_ropes
from kvprof.traces.spec import WorkflowSpec
from kvprof.traces.trace import trace_header

if TYPE_CHECKING:
    from kvprof.traces.trace import TraceHeader

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# The canonical order of LoRA target module names (Llama-style decoders), used to list an adapter's targets.
LORA_TARGET_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` is CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KvprofError(f"--device {device} asks for CUDA but this machine has no CUDA GPU; use --device cpu.")
    try:
        return torch.device(device)
    except RuntimeError:
        raise KvprofError(f"--device {device!r} is not a device torch knows; use auto, cpu or cuda[:N].") from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise KvprofError(f"--dtype {dtype!r} is unknown; use auto, float32, bfloat16 or float16.")
    return DTYPES[dtype]


def _load_error(what: str, name: str, err: Exception) -> KvprofError:
    if Path(name).exists():
        return KvprofError(
            f"could not load the {what} from {name} ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "check that it is a complete Hugging Face model directory."
        )
    return KvprofError(
        f"model {name!r} is not a local directory and could not be fetched from the hub "
        f"(this machine may be offline); pass --model with a local model directory."
    )


def check_model_path(name: str) -> None:
    """Refuse at once a missing `--model` that can only be a local path (`.`, `/`, `~`, or several `/`), rather than
    let the hub client retry for a minute."""
    local = name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
    if local and not Path(name).expanduser().exists():
        raise KvprofError(f"model directory {name} does not exist; pass --model with a local model directory.")


def load_tokenizer(name: str):
    """The tokenizer of model `name` (a directory may hold the tokenizer alone); refuses a local directory whose
    config.json transformers refuses or that holds no tokenizer files, and one that cannot round-trip text (stop
    strings, recorded outputs)."""
    from transformers import AutoTokenizer

    check_model_path(name)
    directory = Path(name).expanduser()
    if directory.is_dir():
        if (directory / "config.json").exists():  # transformers reads it to pick the tokenizer: checked first
            load_model_config(name)
        check_tokenizer_files(directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise _load_error("tokenizer", name, err) from None
    try:
        tokenizer.decode(tokenizer.encode("Question: search[X]\n", add_special_tokens=False))
    except Exception as err:  # whatever the tokenizer raises, it cannot round-trip text
        reason = f"{type(err).__name__}: {str(err).splitlines()[0]}" if str(err) else type(err).__name__
        raise KvprofError(
            f"the tokenizer of {name} cannot turn token ids back into text ({reason}), which kvprof needs to find "
            "stop strings and record outputs; pass --model with a model whose tokenizer decodes."
        ) from None
    return tokenizer


def tokenizer_identity(tokenizer) -> dict:
    """Name, vocabulary size and a fingerprint of the vocabulary and special tokens: traces record it."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps([vocab, tokenizer.all_special_tokens]).encode()).hexdigest()
    return {"name": tokenizer.name_or_path, "vocab_size": len(tokenizer), "fingerprint": f"sha256:{digest[:32]}"}


def check_layers(model) -> None:
    """Refuse a model per-layer caches cannot hold: a layer with neither attention nor a recurrent mixer, or layers
    reading another's cache (Gemma 3n / 4 KV sharing)."""
    for index, layer in enumerate(decoder_layers(model)):
        if recurrent_of(layer) is None:
            attention_of(layer, index)
    if getattr(model.config, "num_kv_shared_layers", 0):
        raise KvprofError(
            f"model {model.config.name_or_path!r} has layers that read another layer's K/V cache "
            "(num_kv_shared_layers); kvprof keeps a cache per layer, so it cannot profile this model yet."
        )


def load_model_config(name: str):
    """The transformers config of model `name`; a local directory's config.json is read first, so a file that is
    not JSON, not an object or not a config transformers knows is refused naming it."""
    from transformers import AutoConfig

    directory = Path(name).expanduser()
    if directory.is_dir():
        read_model_config(directory)
    try:
        return AutoConfig.from_pretrained(name)
    except OSError as err:
        raise _load_error("model config", name, err) from None
    except Exception as err:  # a hand-edited config.json reaches transformers' validators, which raise anything
        where = directory / "config.json" if directory.is_dir() else name
        raise KvprofError(
            f"model config {where} is refused by transformers ({reason_of(err)}); fix that field of config.json, "
            "or for an architecture this transformers does not know, upgrade transformers."
        ) from None


def _from_pretrained(name: str, config, dtype: torch.dtype, attn: str):
    """transformers' model and loading report for `name`, attending with `attn` (eager where there is no sdpa);
    sizes that do not match are reported rather than raised (`check_loading_report` refuses them)."""
    from transformers import AutoModelForCausalLM

    load = dict(config=config, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)
    try:
        return AutoModelForCausalLM.from_pretrained(name, attn_implementation=attn, **load)
    except ValueError as err:
        if attn != "sdpa" or "scaled_dot_product_attention" not in str(err):
            raise
        # An architecture without sdpa support (e.g. Gemma 2 in transformers 5): its own eager attention.
        return AutoModelForCausalLM.from_pretrained(name, attn_implementation="eager", **load)


def load_base_model(name: str, dtype: torch.dtype, device: torch.device, attn: str = "sdpa"):
    """The causal LM `name` in `dtype` on `device`, attending with `attn` (eager where there is no sdpa); its files
    and tensors checked (`kvprof.model.checks`) so that a broken model is refused in one sentence."""
    check_model_path(name)
    note_loading()
    config = load_model_config(name)
    directory = Path(name).expanduser()
    shapes = checkpoint_shapes(directory) if directory.is_dir() else None
    limit = layer_limit()
    if limit is not None:
        config = first_layers_config(config, limit)
    elif shapes is not None:
        check_weights_fit_config(config, shapes, directory)
    try:
        model, info = _from_pretrained(name, config, dtype, attn)
    except (OSError, ValueError) as err:
        raise _load_error("model", name, err) from None
    except torch.OutOfMemoryError:
        raise KvprofError(
            f"model {name!r} does not fit in memory on {device}; use a smaller --dtype (bfloat16) or another --device."
        ) from None
    if limit is not None:
        info["unexpected_keys"] = [key for key in info.get("unexpected_keys") or [] if not beyond_limit(key, limit)]
    check_loading_report(info, name)
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    check_finite(tensors, f"model {name}", f"{MODEL_FIX} whose weights are finite")
    check_layers(model)
    try:
        model = model.to(device).eval()
    except torch.OutOfMemoryError:
        raise KvprofError(
            f"model {name!r} does not fit in {device} memory; use --dtype bfloat16, a smaller model, or --device cpu."
        ) from None
    check_forward(model, name)
    note_loaded(model)
    return model


def model_layer_kinds(name: str, device: str = "auto", dtype: str = "auto") -> list[LayerKind]:
    """The `LayerKind`s of the model `name`, loaded without adapters (`--device` / `--dtype` values)."""
    where = resolve_device(device)
    model = load_base_model(name, resolve_dtype(dtype, where), where)
    return layer_kinds(model, model_ropes(model))


def check_forward(model, name: str) -> None:
    """Refuse a model that cannot run its own forward on a few tokens (config not matching its modeling code)."""
    ids = torch.arange(1, 5, device=next(model.parameters()).device)[None] % model.config.vocab_size
    try:
        with torch.inference_mode():
            model(input_ids=ids)
    except (RuntimeError, ValueError, IndexError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise KvprofError(
            f"model {name!r} fails its own forward pass on 4 tokens ({type(err).__name__}: {reason}); its "
            "config.json does not match its modeling code (head sizes, head counts, expert groups): fix the config."
        ) from None


# ---------------------------------------------------------------------------------------------------- adapters


@dataclass
class AdapterInfo:
    """What a LoRA adapter touches: projection names, rank, scaling, and whether MLP layers are adapted."""

    path: str
    rank: int
    alpha: float
    targets: list[str]
    layers: int
    modules: frozenset[str] = frozenset()  # the modules whose A and B its weights hold ("model.layers.0...q_proj")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def describe(self) -> str:
        return f"r={self.rank}, alpha={self.alpha:g}, on {'/'.join(t.removesuffix('_proj') for t in self.targets)}"


def read_adapter_config(path: str) -> dict:
    """An adapter directory's adapter_config.json, refused unless a LoRA config with an integer rank and a numeric
    alpha (an Activated LoRA also naming its task, without which peft never applies it)."""
    config_path = Path(path) / "adapter_config.json"
    if not config_path.is_file():
        raise KvprofError(
            f"adapter {path} has no adapter_config.json; pass a PEFT adapter directory "
            "(the folder written by save_pretrained)."
        )
    config = check_fields(read_json_file(config_path, "adapter config", ADAPTER_FIX), {}, str(config_path), ADAPTER_FIX)
    if config.get("peft_type") != "LORA":
        raise KvprofError(f"adapter {path} is a {config.get('peft_type')} adapter; kvprof profiles LoRA adapters.")
    check_fields(config, {"r": int, "lora_alpha": (int, float, type(None))}, str(config_path), ADAPTER_FIX)
    if config.get("alora_invocation_tokens") and config.get("task_type") != "CAUSAL_LM":
        raise KvprofError(
            f"adapter {path} is an Activated LoRA (alora_invocation_tokens) without task_type CAUSAL_LM, so peft "
            'never applies it (every call runs the base model); set "task_type": "CAUSAL_LM" in its '
            "adapter_config.json."
        )
    return config


def adapter_weight_shapes(path: str, base_model, base_name: str | None) -> dict[tuple[str, str], tuple[int, ...]]:
    """The shapes of an adapter's LoRA A and B weights by module name and side ("...q_proj", "A"), each checked
    against `base_model`'s module; a module it lacks or a dimension that differs is an adapter for another base."""
    weights_path = Path(path) / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise KvprofError(f"adapter {path} has no adapter_model.safetensors; re-save it with safetensors.")
    modules = dict(base_model.named_modules())
    shapes: dict[tuple[str, str], tuple[int, ...]] = {}
    for key, shape in safetensors_shapes(weights_path, "adapter weights file", ADAPTER_FIX).items():
        match = re.match(r"(?:base_model\.model\.)?(.*)\.lora_([AB])\.weight$", key)
        if not match:
            continue
        module_name, which = match.groups()
        limit = layer_limit()
        if limit is not None and beyond_limit(module_name, limit):
            continue  # a plan's probe: the model's later layers are not loaded
        module = modules.get(module_name)
        if module is None or not hasattr(module, "in_features"):
            raise KvprofError(
                f"adapter {path} targets {module_name}, which the base model does not have "
                f"(adapter trained for {base_name or 'another base model'}); pass an adapter trained on this --model."
            )
        expected_dim = module.in_features if which == "A" else module.out_features
        actual_dim = shape[1] if which == "A" else shape[0]
        if len(shape) != 2 or actual_dim != expected_dim:
            raise KvprofError(
                f"adapter {path} was trained for another base model ({base_name or 'unknown'}): "
                f"{module_name}.lora_{which} has dimension {actual_dim} where this model's {module_name} has "
                f"{expected_dim}; pass an adapter trained on this --model."
            )
        shapes[module_name, which] = shape
    if not shapes:
        raise KvprofError(f"adapter {path} holds no LoRA weights; pass a trained PEFT LoRA adapter.")
    return shapes


def inspect_adapter(path: str, base_model) -> AdapterInfo:
    """Read an adapter's config and weights and check they fit `base_model` (`kvprof.model.checks`: rank, alpha,
    target modules, finite weights); refuse clearly when they do not."""
    config = read_adapter_config(path)
    config_path = Path(path) / "adapter_config.json"
    shapes = adapter_weight_shapes(path, base_model, config.get("base_model_name_or_path"))
    check_adapter_config(config, config_path, [shape[0] for (_, which), shape in shapes.items() if which == "A"])
    check_target_modules(config, config_path, [name for name, _ in base_model.named_modules()])
    weights_path = Path(path) / "adapter_model.safetensors"
    check_finite(safetensors_tensors(weights_path), f"adapter {path}", f"{ADAPTER_FIX} whose weights are finite")
    targets = {module_name.rsplit(".", 1)[-1] for module_name, _ in shapes}
    layers = {int(found.group(1)) for name, _ in shapes if (found := re.search(r"layers\.(\d+)\.", name))}
    ordered = [p for p in LORA_TARGET_ORDER if p in targets] + sorted(targets - set(LORA_TARGET_ORDER))
    return AdapterInfo(
        path=str(path),
        rank=int(config["r"]),
        alpha=float(config["r"] if config.get("lora_alpha") is None else config["lora_alpha"]),
        targets=ordered,
        layers=len(layers),
        modules=frozenset(module_name for module_name, _ in shapes),
    )


def load_peft_adapters(base_model, agents, adapters: dict[str, AdapterInfo]) -> object:
    """A `PeftModel` on `base_model` holding each of `agents`' adapter under the agent's name; an adapter peft
    refuses (a config field of a wrong type or value), or whose config adapts other modules than its weights hold
    (`adapters`: `inspect_adapter`'s), is refused naming its directory."""
    from peft import PeftModel

    model = base_model
    for index, agent in enumerate(agents):
        try:
            if index == 0:
                model = PeftModel.from_pretrained(base_model, agent.adapter, adapter_name=agent.name)
            else:
                model.load_adapter(agent.adapter, adapter_name=agent.name)
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
            raise KvprofError(
                f"adapter {agent.adapter} is refused by peft ({reason_of(err)}); fix its adapter_config.json or "
                f"{ADAPTER_FIX}."
            ) from None
        weighted = adapters[agent.name].modules
        limit = layer_limit()
        if limit is not None:
            weighted = frozenset(module for module in weighted if not beyond_limit(module, limit))
        check_adapter_coverage(model, agent.name, agent.adapter, weighted)
    return model


# ---------------------------------------------------------------------------------------------------- agent set


class AgentSet:
    """One base model and its agents; `model`: a `PeftModel` with each agent's adapter (lora mode), else the base."""

    def __init__(self, spec: WorkflowSpec, base_model, tokenizer, model_name: str):
        self.spec = spec
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.base_model = base_model
        self.adapters: dict[str, AdapterInfo] = {}
        self.model = base_model
        if spec.mode == "lora":
            for agent in spec.agents:
                # A lora-mode spec names an adapter for every agent (`kvprof.traces.spec.build_spec` refuses one
                # without).
                assert agent.adapter is not None, f"lora-mode agent {agent.name!r} has no adapter"
                self.adapters[agent.name] = inspect_adapter(agent.adapter, base_model)
            self.model = load_peft_adapters(base_model, spec.agents, self.adapters)
            self.model.eval()
            for agent in spec.agents:
                self.check_activated_lora(agent.name)

    def check_activated_lora(self, agent: str) -> None:
        """Refuse an aLoRA agent whose layer outputs, K or V before its invocation are not the base model's (≤ 1e-6
        relative in float32, the dtype's rounding else): exact sharing rests on it (a hybrid's states too)."""
        tokens = invocation_tokens(self.model, agent)
        if tokens is None:
            return
        context = self.tokenizer.encode("Context read before the call.", add_special_tokens=False)
        ids = torch.tensor([context + tokens + context], device=self.device)
        runs = []
        for adapter in (agent, None):
            with self.activate(adapter), torch.inference_mode():
                runs.append(self.model(input_ids=ids, use_cache=True, output_hidden_states=True))
        tolerance = 1e-6 if self.base_model.dtype == torch.float32 else 1e-2
        pairs = [  # every layer's output (a hybrid's recurrent layers keep no K/V per token), then each K and V
            (ours[:, : len(context)], theirs[:, : len(context)])
            for ours, theirs in zip(runs[0].hidden_states, runs[1].hidden_states)
        ]
        for adapted, base in zip(runs[0].cache.layers, runs[1].cache.layers):
            if hasattr(adapted, "keys"):
                pairs += [(adapted.keys[:, :, : len(context)], base.keys[:, :, : len(context)])]
                pairs += [(adapted.values[:, :, : len(context)], base.values[:, :, : len(context)])]
        for ours, theirs in pairs:
            before, reference = ours.float(), theirs.float()
            error = float((before - reference).norm() / reference.norm().clamp_min(1e-12))
            if error > tolerance:
                raise KvprofError(
                    f"agent {agent}'s Activated LoRA changes the K/V or states before its invocation (relative "
                    f"error {error:.2e}), so no cache of it is the base model's; check the adapter's "
                    "alora_invocation_tokens and the peft version (aLoRA needs peft ≥ 0.17)."
                )

    @property
    def device(self) -> torch.device:
        return next(self.base_model.parameters()).device

    @property
    def config(self):
        return self.base_model.config

    @functools.cached_property
    def ropes(self) -> LayerRopes:
        """Each layer's RoPE (`kvprof.model.rope.model_ropes`), checked once, adapters off."""
        with self.activate(None):
            return model_ropes(self.base_model)

    @functools.cached_property
    def layer_kinds(self) -> list[LayerKind]:
        """Each layer's attention kind and position encoding (`kvprof.model.layers.layer_kinds`)."""
        return layer_kinds(self.base_model, self.ropes)

    @functools.cached_property
    def recurrent(self) -> dict[int, str]:
        """A hybrid model's recurrent layers, by index, with their token mixer's name (`kvprof.model.recurrent`)."""
        return recurrent_layers(self.base_model)

    @functools.cached_property
    def cache_shapes(self) -> list[tuple[int, int, int]]:
        """Per layer (H_kv, D_k, D_v) of its cache as its kind reads it (`kvprof.model.layers.cache_shapes`)."""
        return cache_shapes(self.base_model, self.layer_kinds)

    @functools.cached_property
    def latent(self) -> dict[int, LatentShape]:
        """The layers that cache a multi-head latent attention latent, by index (`kvprof.model.latent`)."""
        return latent_layers(self.base_model)

    @contextlib.contextmanager
    def activate(self, agent: str | None) -> Iterator[None]:
        """Run the model as `agent` (its adapter in lora mode); `None` runs the base with adapters disabled."""
        if self.spec.mode != "lora":
            yield
            return
        if agent is None:
            with self.model.disable_adapter():
                yield
            return
        self.spec.agent(agent)
        if self.model.active_adapter != agent:  # peft's set_adapter walks every module: only switch when needed
            self.model.set_adapter(agent)
        yield


def load_agents(
    spec: WorkflowSpec, model_name: str, device: str = "auto", dtype: str = "auto", attn: str = "sdpa"
) -> AgentSet:
    """Load tokenizer, base model and every agent of `spec`."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    tokenizer = load_tokenizer(model_name)
    base = load_base_model(model_name, torch_dtype, torch_device, attn)
    return AgentSet(spec, base, tokenizer, model_name)


def agents_identity(agents: AgentSet) -> dict:
    """What a replay's checkpoint records of the loaded agents: model, adapters, role prompts, dtype, device."""
    return {
        "model": agents.model_name,
        "agents": [asdict(agent) for agent in agents.spec.agents],
        "dtype": str(agents.base_model.dtype).removeprefix("torch."),
        "device": str(agents.device),
    }


def load_agents_for_trace(
    trace_path,
    model: str | None = None,
    workflow=None,
    agent_flags: list[str] | None = None,
    role_flags: list[str] | None = None,
    device: str = "auto",
    dtype: str = "auto",
    attn: str = "sdpa",
) -> AgentSet:
    """Load a trace's model and agents (`model` and agent flags override the header); refuses another tokenizer.
    Relative paths resolve against the trace's folder when they exist there, else the working directory."""
    return load_agents_for_header(
        trace_header(trace_path), str(trace_path), model, workflow, agent_flags, role_flags, device, dtype, attn
    )


def load_agents_for_header(
    header: TraceHeader,
    trace_name: str,
    model: str | None = None,
    workflow=None,
    agent_flags: list[str] | None = None,
    role_flags: list[str] | None = None,
    device: str = "auto",
    dtype: str = "auto",
    attn: str = "sdpa",
) -> AgentSet:
    """`load_agents_for_trace` from the header alone (a remote replay worker); `trace_name` for refusals."""
    from kvprof.traces.spec import build_spec
    from kvprof.traces.trace import check_tokenizer

    base = WorkflowSpec.from_dict(header.workflow) if "system_prompt" in header.workflow else None
    if base is None:
        base = WorkflowSpec(mode=header.mode, agents=[])
    spec = build_spec(workflow, agent_flags, role_flags, base=base)
    unknown = set(spec.names) - set(header.agent_names)
    if unknown:
        raise KvprofError(
            f"unknown agent name {', '.join(map(repr, sorted(unknown)))} for trace {trace_name}; "
            f"its agents are {', '.join(header.agent_names)}."
        )
    model_name = model or header.model.get("path")
    if not model_name:
        raise KvprofError(f"trace {trace_name} does not record its model; pass --model.")
    agents = load_agents(spec, model_name, device=device, dtype=dtype, attn=attn)
    check_tokenizer(header, tokenizer_identity(agents.tokenizer), trace_name, model_name)
    return agents

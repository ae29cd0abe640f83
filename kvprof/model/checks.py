"""The files a user brings as a model or an adapter, checked so that each fault is refused in one sentence naming the
file and the fix (`KvprofError`), before loading where the files alone tell, after loading where only the loaded
tensors do:

- a model directory: config.json parses and describes a model transformers builds, its weights are complete
  safetensors (`checkpoint_shapes`), hold as many layers as it asks for and are not far smaller than that model (a
  config whose sizes or layer count were edited up would otherwise allocate them), a tokenizer is there; after
  loading, the loading report holds no tensor the config wants and the weights lack, none they hold that it has no
  place for, no shape that differs (`check_loading_report`);
- an adapter: its adapter_config.json's rank and scaling, its weights complete, the modules peft adapts those its
  weights are for;
- every tensor, base and adapter, finite (`check_finite`: one pass of `torch.isfinite` per tensor, once at load).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kvprof.errors import KvprofError
from kvprof.fileio import is_json, read_json_file

MODEL_FIX = "pass --model with a complete Hugging Face model directory"
ADAPTER_FIX = "pass a PEFT LoRA adapter directory (the folder written by save_pretrained)"
# Files a transformers tokenizer loads from; a model directory with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer_config.json",
)
WEIGHTS_INDEX = "model.safetensors.index.json"
# A config asking for more than this many times the parameters its weights hold is refused before it allocates any.
OVERSIZED_CONFIG = 2
LAYER_INDEX = re.compile(r"\blayers\.(\d+)\.")  # a decoder layer's index in a weight's name
FINITE_CHUNK = 2**24  # elements per `torch.isfinite` call: its boolean mask stays at 16 MiB for any tensor


def reason_of(err: BaseException) -> str:
    """An exception as a short clause: its type and the first line of its message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0].strip()}" if lines else type(err).__name__


def safetensors_shapes(path: Path, kind: str, fix: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the safetensors file `path` (headers only); a missing, truncated or corrupt file is
    refused naming it (`kind`: "model weights file")."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise KvprofError(f"{kind} {path} does not exist; {fix}.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise KvprofError(
            f"{kind} {path} is not a complete safetensors file ({reason_of(err)}); it may be half-downloaded or "
            f"cut short: download or save it again."
        ) from None


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """The shapes of a model directory's safetensors weights, every shard of `WEIGHTS_INDEX` included; None where
    the weights are not safetensors (transformers reports those itself)."""
    index_path = directory / WEIGHTS_INDEX
    if index_path.is_file():
        index = read_json_file(index_path, "weights index", MODEL_FIX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise KvprofError(f"weights index {index_path} has no 'weight_map' of shard files; {MODEL_FIX}.")
        shapes: dict[str, tuple[int, ...]] = {}
        for shard in sorted(set(weight_map.values())):
            shapes.update(safetensors_shapes(directory / shard, "model weights shard", MODEL_FIX))
        return shapes
    if (directory / "model.safetensors").is_file():
        return safetensors_shapes(directory / "model.safetensors", "model weights file", MODEL_FIX)
    return None


def read_model_config(directory: Path) -> dict:
    """A local model directory's config.json as a JSON object, refused in one sentence when missing or not one."""
    path = directory / "config.json"
    config = read_json_file(path, "model config", f"{MODEL_FIX} (its config.json is written by save_pretrained)")
    if not isinstance(config, dict):
        raise KvprofError(f"model config {path} is not a JSON object; fix it or {MODEL_FIX}.")
    return config


def check_tokenizer_files(directory: Path) -> None:
    """Refuse a local model directory holding none of `TOKENIZER_FILES`."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise KvprofError(
            f"model directory {directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy its base "
            "model's tokenizer files into it (tokenizer.save_pretrained)."
        )


def check_weights_fit_config(model_config, shapes: dict[str, tuple[int, ...]], directory: Path) -> None:
    """Refuse a config.json asking for more layers than the weights hold, one that builds no model, or one with more
    than `OVERSIZED_CONFIG` times the parameters the weights hold (built on the meta device: nothing allocated). A
    quantized base stores fewer elements than it has parameters: only whether it builds is checked."""
    from transformers import AutoModelForCausalLM

    config_path = directory / "config.json"
    layers = getattr(model_config, "num_hidden_layers", None)
    stored = {int(found.group(1)) for key in shapes if (found := LAYER_INDEX.search(key))}
    if isinstance(layers, int) and stored and layers > max(stored) + 1:  # before building them, however many
        raise KvprofError(
            f"model config {config_path} asks for {layers} layers but its weights hold {max(stored) + 1}: its sizes "
            "do not match the weights; restore the config.json saved with these weights."
        )
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model_config)
    except Exception as err:  # a hand-edited config reaches transformers' constructors, which raise anything
        raise KvprofError(
            f"model config {config_path} describes no model transformers can build ({reason_of(err)}); fix that "
            "field of config.json or download it again."
        ) from None
    if getattr(model_config, "quantization_config", None) is not None:
        return
    wanted = sum(parameter.numel() for parameter in skeleton.parameters())
    held = sum(math.prod(shape) for shape in shapes.values())
    if wanted > OVERSIZED_CONFIG * held:
        raise KvprofError(
            f"model config {config_path} describes a model of {wanted:,} parameters but its weights hold {held:,}: "
            "its sizes do not match the weights; restore the config.json saved with these weights."
        )


def check_loading_report(info: dict, name: str) -> None:
    """Refuse a model whose weights and config.json disagree, from transformers' loading report (`info` of
    `output_loading_info=True`, sizes mismatched allowed): a shape that differs, a tensor the config wants that the
    weights lack (it would run on random values), or weights it has no place for (they would be dropped)."""
    fix = f"restore the config.json saved with these weights, or {MODEL_FIX}"
    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda entry: entry[0])
    if mismatched:
        key, stored, built = mismatched[0]
        raise KvprofError(
            f"the weights of {name} do not match its config.json: {key} is {list(stored)} in the weights but "
            f"{list(built)} by the config ({len(mismatched)} tensors differ); {fix}."
        )
    for field, says in (("missing_keys", "lack"), ("unexpected_keys", "hold, which the config has no place for,")):
        keys = sorted(info.get(field) or [])
        if keys:
            raise KvprofError(
                f"the weights of {name} do not match its config.json: they {says} {len(keys)} tensors "
                f"({keys[0]}{', ...' if len(keys) > 1 else ''}); {fix}."
            )


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int] | None:
    """(name, count of NaN / Inf values) of the first tensor holding any, or None: one `torch.isfinite` pass per
    tensor, in chunks of `FINITE_CHUNK` elements."""
    for name, tensor in tensors:
        if not tensor.is_floating_point():
            continue
        flat = tensor.detach().reshape(-1)
        bad = sum(int((~torch.isfinite(chunk)).sum()) for chunk in flat.split(FINITE_CHUNK))
        if bad:
            return name, bad
    return None


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], what: str, fix: str) -> None:
    """Refuse `what` ("model X", "adapter Y") when any of its `tensors` holds NaN or Inf."""
    found = first_non_finite(tensors)
    if found is not None:
        name, count = found
        raise KvprofError(f"{what} has non-finite weights ({count:,} NaN or Inf values in {name}); {fix}.")


def check_adapter_config(config: dict, config_path: Path, ranks: Iterable[int]) -> None:
    """Refuse an adapter config whose rank is not a positive integer up to the largest rank of its weights
    (`ranks`, read from them: a larger one is not these weights, and peft would allocate it), or whose scaling is
    not a finite number."""
    largest = max(ranks, default=0)
    patterns = config.get("rank_pattern") or {}
    named = [("r", config.get("r"))]
    if isinstance(patterns, dict):
        named += [(f"rank_pattern[{json.dumps(key)}]", value) for key, value in patterns.items()]
    for field, rank in named:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= largest:
            raise KvprofError(
                f"adapter config {config_path}, field {field} is {json.dumps(rank)}, but a LoRA rank is a positive "
                f"integer and its weights have rank {largest}; set it to the rank the adapter was trained with."
            )
    for field in ("lora_alpha", "alpha_pattern"):
        values = config.get(field)
        values = values.values() if isinstance(values, dict) else [values]
        if any(value is not None and not (is_json(value, (int, float)) and math.isfinite(value)) for value in values):
            raise KvprofError(
                f"adapter config {config_path}, field {field} holds {json.dumps(config.get(field))}, not a finite "
                "number; set it to the adapter's LoRA alpha."
            )


def check_target_modules(config: dict, config_path: Path, module_names: list[str]) -> None:
    """Refuse an adapter config whose `target_modules` is not a list of names or a pattern, or whose list names no
    module of the model (peft's rule: a module's name, or the end of one after a dot); a pattern or none (peft's
    defaults) is left to peft."""
    targets = config.get("target_modules")
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, list) or not all(isinstance(target, str) for target in targets):
        raise KvprofError(
            f"adapter config {config_path}, field target_modules is {json.dumps(targets)}, not a list of module "
            "names or a pattern; set it to the names of the projections the adapter was trained on."
        )
    if not any(name == target or name.endswith(f".{target}") for target in targets for name in module_names):
        linear = sorted({name.rsplit(".", 1)[-1] for name in module_names if ".layers." in name and "proj" in name})
        raise KvprofError(
            f"adapter config {config_path}, field target_modules names {', '.join(targets) or 'nothing'}, none of "
            f"which is a module of this model ({', '.join(linear[:8]) or 'see its named_modules'}); set it to the "
            "projections the adapter was trained on, or pass an adapter trained on this --model."
        )


def safetensors_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each tensor in the safetensors file `path`, read one at a time (checked complete first:
    `safetensors_shapes`)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():
            yield key, handle.get_tensor(key)


def check_adapter_coverage(peft_model, agent: str, path: str, weighted: frozenset[str]) -> None:
    """Refuse an adapter loaded as `agent` whose config made peft adapt other modules than its weights hold
    (`weighted`): weights of a module it does not adapt are dropped, a module without weights runs on fresh
    initial values (target_modules, layers_to_transform or exclude_modules edited)."""
    adapted = {
        name.removeprefix("base_model.model.")
        for name, module in peft_model.named_modules()
        if agent in getattr(module, "lora_A", {})
    }
    fix = "set target_modules (and layers_to_transform) back to the modules the adapter was trained on"
    dropped, empty = sorted(weighted - adapted), sorted(adapted - weighted)
    if dropped:
        raise KvprofError(
            f"adapter {path} holds weights for {len(dropped)} modules its adapter_config.json does not adapt "
            f"({dropped[0]}{', ...' if len(dropped) > 1 else ''}), which peft would drop; {fix}."
        )
    if empty:
        raise KvprofError(
            f"adapter {path}'s adapter_config.json adapts {len(empty)} modules its weights do not cover "
            f"({empty[0]}{', ...' if len(empty) > 1 else ''}), which would run on fresh initial values; {fix}."
        )

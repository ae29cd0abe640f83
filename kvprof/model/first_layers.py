"""A model cut to its first k decoder layers, as the run plan's probes load it (`kvprof.planning`).

Everything a replay holds per layer (weights, stored caches, a turn's caches) grows by the same amount with every
layer of a kind, and the rest (embedding, head, the process itself) does not; so two runs on the first k and 3k (or 2k)
layers of the model, on the same inputs, give both parts for the whole model. `probe_layers` cuts the config
(`first_layers_config`) in `load_base_model`, which skips the weights of the later layers (and each adapter's weights
for them) instead of refusing them as a mismatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from kvprof.model.architecture import weights_bytes
from kvprof.model.checks import LAYER_INDEX
from kvprof.profiling import resident_host_bytes

PER_LAYER_KIND_FIELDS = ("layer_types", "layers_block_type")  # a config's kind of each layer, where it has one


@dataclasses.dataclass
class ProbeLoad:
    """A probe's model: its first `layers` decoder layers; the process's resident bytes as the model starts loading
    (`process_bytes`: interpreter and libraries) and the base model's `weights_bytes` once loaded."""

    layers: int
    process_bytes: int | None = None
    weights_bytes: int | None = None


_probes: list[ProbeLoad] = []  # the probe loading models now (`probe_layers`)


@contextlib.contextmanager
def probe_layers(layers: int) -> Iterator[ProbeLoad]:
    """Within this context, `load_base_model` loads the model's first `layers` decoder layers only, and records
    its weights' bytes in the `ProbeLoad` yielded."""
    probe = ProbeLoad(layers)
    _probes.append(probe)
    try:
        yield probe
    finally:
        _probes.pop()


def layer_limit() -> int | None:
    """The layers a probe keeps (`probe_layers`), None outside a probe."""
    return _probes[-1].layers if _probes else None


def note_loading() -> None:
    """Record the process's size as a probe's model starts loading (no-op outside a probe)."""
    if _probes and _probes[-1].process_bytes is None:
        _probes[-1].process_bytes = resident_host_bytes()


def note_loaded(model) -> None:
    """Record the base model's weights a probe loaded (no-op outside a probe)."""
    if _probes:
        _probes[-1].weights_bytes = weights_bytes(model)


def text_config(config):
    """The config holding the decoder's layers (a multimodal model's `text_config`, else the config itself)."""
    inner = getattr(config, "text_config", None)
    return inner if inner is not None and hasattr(inner, "num_hidden_layers") else config


def layer_kinds_of_config(config) -> list[str]:
    """Each decoder layer's kind as the config names it (`layer_types` or Nemotron-H's `layers_block_type`), or one
    kind for every layer."""
    text = text_config(config)
    for name in PER_LAYER_KIND_FIELDS:
        kinds = getattr(text, name, None)
        if isinstance(kinds, (list, tuple)) and len(kinds) == text.num_hidden_layers:
            return [str(kind) for kind in kinds]
    return ["decoder"] * int(text.num_hidden_layers)


PROBE_MIN_LAYERS = 2  # a policy may name a layer past the first (CacheBlend checks layer 1)


def smallest_probe(config) -> int:
    """The fewest first layers holding a layer of every kind the model has, and at least `PROBE_MIN_LAYERS`."""
    kinds = layer_kinds_of_config(config)
    return max(PROBE_MIN_LAYERS, *(kinds.index(kind) + 1 for kind in set(kinds)))


def first_layers_config(config, layers: int):
    """A copy of `config` whose decoder has its first `layers` layers: `num_hidden_layers` set, each per-layer list
    (a list as long as the layers) cut, each list of layer indices (`*_idxs`, `*_indices`) kept below `layers`."""
    cut = config.__class__.from_dict(config.to_dict())
    text = text_config(cut)
    total = int(text.num_hidden_layers)
    for name, value in list(vars(text).items()):
        if not isinstance(value, list):
            continue
        if name.endswith(("_idxs", "_indices")):
            setattr(text, name, [index for index in value if isinstance(index, int) and index < layers])
        elif len(value) == total:
            setattr(text, name, value[:layers])
    text.num_hidden_layers = layers
    return cut


def beyond_limit(name: str, layers: int) -> bool:
    """Whether weight or module `name` belongs to a decoder layer at index ≥ `layers`."""
    found = LAYER_INDEX.search(name)
    return found is not None and int(found.group(1)) >= layers

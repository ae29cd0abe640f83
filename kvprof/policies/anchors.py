"""Anchor pools: what the delta-correction policies know about how a shared segment's K/V change with its context.

Everything is in the segment's own frame (keys rotated back to positions 0..L−1, `kvprof.model.rope.rotate_keys`),
stacked (layers, H_kv, L, D). `Stored`: full-dimensional (KVComm) or per-layer rank-r truncated SVD of the
(L × H_kv·D) matrix, U (layers, L, r) · V (layers, r, H_kv·D) (KVCMAS). `Anchor`: a slot's observed segment — base B
(its `owner`'s cache, or the context-free encoding) and per-agent deltas Δ_a = C_a − B. `AnchorPool`: anchors per
slot; `match` (KVCOMM's `predict_as_anchor`, `_compute_anchor_weight_entry`), `mixed_delta`, admission and eviction
as the code's `set_anchor` / `update_anchor` (up to V + 1 per slot), `activate` (the code's top-p cut-off), `save` /
`load` (safetensors, model and tokenizer identity checked). The gate and correction: docs/policies/delta.md.

Memory (`nbytes` = `analytic_bytes`): per stored matrix layers·H_kv·L·D elements, or layers·r_eff·(L + H_kv·D) with
r_eff = min(r, L, H_kv·D); an anchor read by N agents holds N matrices (N + 1 with a context-free base) for K and V.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvprof.errors import KvprofError
from kvprof.fileio import JsonType, atomic_open, check_fields, require_file
from kvprof.kernels.attention import MAX_RANK
from kvprof.kernels.correction import low_rank_correction

POOL_KIND = "kvprof.anchor-pool"
POOL_VERSION = 2
POOL_FIX = "pass a file written by kvprof fit-anchors"
POOL_FILE = "anchors.safetensors"  # the pool fit-anchors and tune-tau write in their OUT
ANCHOR_FIELDS: dict[str, JsonType] = {"name": str, "owner": (str, type(None)), "agents": list, "activations": int}
TOP_P = 0.9  # the share of an accepted match's weight whose anchors count an activation (the public KVCOMM code's)
ENTROPY_EPS = 1e-40  # added inside the gate's log2, as the public KVCOMM code does


@dataclass
class Stored:
    """One (layers, H_kv, L, D) tensor, full-dimensional (`full`) or as per-layer factors (`u` (layers, L, r),
    `v` (layers, r, H_kv·D)); `heads` is H_kv."""

    full: torch.Tensor | None = None
    u: torch.Tensor | None = None
    v: torch.Tensor | None = None
    heads: int = 0

    @classmethod
    def of(cls, tensor: torch.Tensor, rank: int | None) -> Stored:
        """`tensor` (layers, H_kv, L, D) whole (`rank` None) or as per-layer truncated SVD (float32, stored in its
        dtype)."""
        layers, heads, length, head_dim = tensor.shape
        if rank is None:
            return cls(full=tensor.clone(), heads=heads)
        matrix = tensor.float().permute(0, 2, 1, 3).reshape(layers, length, heads * head_dim)
        keep = min(rank, length, heads * head_dim)
        left, sigma, right = torch.linalg.svd(matrix, full_matrices=False)
        u = (left[..., :keep] * sigma[..., None, :keep]).to(tensor.dtype)
        return cls(u=u.contiguous(), v=right[..., :keep, :].to(tensor.dtype).contiguous(), heads=heads)

    @property
    def length(self) -> int:
        return int((self.full if self.full is not None else self.u).shape[-2])  # type: ignore[union-attr]

    @property
    def rank(self) -> int | None:
        return None if self.u is None else int(self.u.shape[-1])

    def tensors(self) -> list[torch.Tensor]:
        return [self.full] if self.full is not None else [self.u, self.v]  # type: ignore[list-item]

    def dense(self, length: int, layers: slice = slice(None)) -> torch.Tensor:
        """The first `length` rows, reconstructed: (layers, H_kv, length, D) float32."""
        if self.full is not None:
            return self.full[layers, :, :length].float()
        assert self.u is not None and self.v is not None
        product = torch.matmul(self.u[layers, :length].float(), self.v[layers].float())  # (layers, L, H·D)
        return product.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def head_factors(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's factors for the correction kernel: U (H_kv, length, r) (shared by heads), V (H_kv, r, D)."""
        assert self.u is not None and self.v is not None
        rank = self.v.shape[-2]
        u = self.u[layer, :length].expand(self.heads, length, rank)
        return u, self.v[layer].unflatten(-1, (self.heads, -1)).transpose(0, 1)


def stored_bytes(layers: int, heads: int, length: int, head_dim: int, rank: int | None, itemsize: int) -> int:
    """Bytes of one `Stored` matrix by the formula in the module docstring."""
    if rank is None:
        return layers * heads * length * head_dim * itemsize
    keep = min(rank, length, heads * head_dim)
    return layers * keep * (length + heads * head_dim) * itemsize


@dataclass
class Anchor:
    """One observed segment of a slot: `name` (trajectory and segment), base cache of `owner` (None: context-free),
    `deltas` agent → (ΔK, ΔV) = C_agent − B, `activations` by accepted matches."""

    name: str
    owner: str | None
    base_keys: Stored
    base_values: Stored
    deltas: dict[str, tuple[Stored, Stored]] = field(default_factory=dict)
    activations: int = 0

    @property
    def length(self) -> int:
        return self.base_keys.length

    def knows(self, agent: str | None) -> bool:
        """Whether the anchor holds `agent`'s cache of its segment (None: the context-free encoding)."""
        return agent == self.owner or (agent is not None and agent in self.deltas)

    def agents(self) -> list[str]:
        """The agents whose cache the anchor holds."""
        return ([self.owner] if self.owner is not None else []) + list(self.deltas)

    def cache(self, agent: str | None, length: int, values: bool, layers: slice = slice(None)) -> torch.Tensor:
        """C_agent = B + Δ_agent on the first `length` rows, (layers, H_kv, length, D) float32."""
        part = 1 if values else 0
        base = (self.base_values if values else self.base_keys).dense(length, layers)
        if agent == self.owner:
            return base
        assert agent is not None
        return base + self.deltas[agent][part].dense(length, layers)

    def stored(self) -> list[Stored]:
        return [self.base_keys, self.base_values] + [part for pair in self.deltas.values() for part in pair]


@dataclass
class Match:
    """A candidate (owned by `source`) against a slot's eligible anchors: gate `weights` (N,) float32, `entropy`
    H(w)/log N in [0, 1] (1 with < 2 anchors), per-token `key_weights` / `value_weights` (N, L) or None."""

    anchors: list[Anchor]
    source: str | None
    weights: torch.Tensor
    entropy: float
    key_weights: torch.Tensor | None = None
    value_weights: torch.Tensor | None = None

    def confident(self, threshold: float) -> bool:
        """The public KVCOMM code's gate: at least two anchors and H(w) ≤ threshold·log2 N (ties accept)."""
        return len(self.anchors) >= 2 and self.entropy <= threshold

    def token_weights(self, values: bool, length: int) -> torch.Tensor:
        """The correction's weights (N, length)."""
        weights = self.value_weights if values else self.key_weights
        if weights is None:
            return self.weights[:, None].expand(len(self.anchors), length)
        return weights


def normalized_entropy(weights: torch.Tensor) -> float:
    """H(w)/log2 N of (N,), H = −Σ w·log2(w + ε) as KVCOMM's code; 1.0 for N < 2."""
    if weights.numel() < 2:
        return 1.0
    probabilities = weights.double()
    entropy = -(probabilities * (probabilities + ENTROPY_EPS).log2()).sum()
    return float(entropy / math.log2(weights.numel()))


def gate_weights(candidate: torch.Tensor, anchors: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax_n(−‖X − A_n‖₂ / temperature) over every element: candidate (layers, H_kv, L, D), anchors
    (N, layers, H_kv, L, D) → (N,) float32."""
    distances = torch.linalg.vector_norm((anchors - candidate.float()).flatten(1), dim=1)
    return torch.softmax(-distances / temperature, dim=0)


def per_token_weights(candidate: torch.Tensor, anchors: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax_n(−mean |X − A_n| / temperature) per token, the mean over layers, heads and dims: candidate (layers,
    H_kv, L, D), anchors (N, layers, H_kv, L, D) → (N, L) float32."""
    distances = (anchors - candidate.float()).abs().mean(dim=(1, 2, 4))
    return torch.softmax(-distances / temperature, dim=0)


class AnchorPool:
    """Anchors per slot: `capacity` V, eviction `window` (oldest anchors considered), factor `rank` (None: full)."""

    def __init__(self, capacity: int, window: int, rank: int | None):
        self.capacity, self.window, self.rank = capacity, window, rank
        self.slots: dict[str, list[Anchor]] = {}

    def anchor(self, slot: str, name: str) -> Anchor | None:
        return next((a for a in self.slots.get(slot, []) if a.name == name), None)

    def add(
        self, slot: str, name: str, owner: str | None, base_keys: torch.Tensor, base_values: torch.Tensor
    ) -> Anchor:
        """A new anchor with base K/V (layers, H_kv, L, D) of `owner`, after `trim` (as the code: up to V + 1)."""
        self.trim(slot)
        return self.insert(slot, name, owner, base_keys, base_values)

    def trim(self, slot: str) -> None:
        """The code's size check (`update_anchor`): above V, drop the least-activated of the oldest `window`."""
        anchors = self.slots.setdefault(slot, [])
        if len(anchors) > self.capacity:
            oldest = anchors[: self.window]
            anchors.remove(min(oldest, key=lambda a: a.activations))

    def insert(
        self, slot: str, name: str, owner: str | None, base_keys: torch.Tensor, base_values: torch.Tensor
    ) -> Anchor:
        """`add` without the size check."""
        anchor = Anchor(name, owner, Stored.of(base_keys, self.rank), Stored.of(base_values, self.rank))
        self.slots.setdefault(slot, []).append(anchor)
        return anchor

    def add_delta(self, anchor: Anchor, agent: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep `agent`'s dense K/V (layers, H_kv, L, D) as its delta (nothing for the owner)."""
        if agent == anchor.owner:
            return
        delta_keys = keys.float() - anchor.base_keys.dense(anchor.length)
        delta_values = values.float() - anchor.base_values.dense(anchor.length)
        dtype = keys.dtype
        anchor.deltas[agent] = (
            Stored.of(delta_keys.to(dtype), self.rank),
            Stored.of(delta_values.to(dtype), self.rank),
        )

    def eligible(
        self, slot: str, length: int, source: str | None, agents: tuple[str, ...], exclude: str = ""
    ) -> list[Anchor]:
        """The slot's anchors at least `length` long holding `source`'s cache and every agent's of `agents`."""
        return [
            a
            for a in self.slots.get(slot, [])
            if a.length >= length and a.name != exclude and a.knows(source) and all(a.knows(agent) for agent in agents)
        ]

    def match(
        self,
        slot: str,
        reference: tuple[torch.Tensor, torch.Tensor],
        source: str | None,
        agents: tuple[str, ...],
        temperature: float,
        exclude: str = "",
        per_token: bool = True,
    ) -> Match:
        """Weigh candidate (K, V) (layers, H_kv, L, D), `source`'s cache, against eligible anchors' C_source;
        `per_token` adds per-token weights."""
        keys, values = reference
        length = values.shape[-2]
        anchors = self.eligible(slot, length, source, agents, exclude)
        if not anchors:
            return Match([], source, torch.zeros(0), 1.0)
        anchor_values = torch.stack([a.cache(source, length, True) for a in anchors])
        weights = gate_weights(values, anchor_values, temperature)
        match = Match(anchors, source, weights, normalized_entropy(weights))
        if per_token:
            anchor_keys = torch.stack([a.cache(source, length, False) for a in anchors])
            match.key_weights = per_token_weights(keys, anchor_keys, temperature)
            match.value_weights = per_token_weights(values, anchor_values, temperature)
        return match

    @staticmethod
    def activate(match: Match, top_p: float = TOP_P) -> None:
        """Count an accepted match for its top anchors by KVCOMM's cut-off: by weight, through the last position
        whose cumulative weight is below `top_p` (all when the first alone reaches it)."""
        order = torch.argsort(match.weights, descending=True)
        below = (torch.cumsum(match.weights[order], dim=0) < top_p).nonzero().flatten()
        cutoff = int(below[-1]) if below.numel() else len(order) - 1
        for index in order[: cutoff + 1].tolist():
            match.anchors[index].activations += 1

    def nbytes(self) -> int:
        """Bytes of the pool's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def analytic_bytes(self, layers: int, heads: int, dims: tuple[int, int], itemsize: int) -> int:
        """`stored_bytes` over every anchor's base and deltas, K and V."""
        return sum(
            (1 + len(anchor.deltas)) * stored_bytes(layers, heads, anchor.length, dim, self.rank, itemsize)
            for anchors in self.slots.values()
            for anchor in anchors
            for dim in dims
        )

    def heads(self) -> int:
        """H_kv of the stored tensors (0 for an empty pool)."""
        return next((a.base_keys.heads for anchors in self.slots.values() for a in anchors), 0)

    def tensors(self) -> list[torch.Tensor]:
        return [t for anchors in self.slots.values() for a in anchors for part in a.stored() for t in part.tensors()]

    # ------------------------------------------------------------------------------------------ files

    def save(self, path: str | Path, identity: dict) -> Path:
        """Write the pool atomically: safetensors, layout and `identity` in the metadata."""
        from safetensors.torch import save

        tensors: dict[str, torch.Tensor] = {}
        layout: dict[str, list[dict]] = {}
        for slot, anchors in self.slots.items():
            rows = layout.setdefault(slot, [])
            for index, anchor in enumerate(anchors):
                parts = {"base.k": anchor.base_keys, "base.v": anchor.base_values}
                for agent, (keys, values) in anchor.deltas.items():
                    parts[f"delta.{agent}.k"], parts[f"delta.{agent}.v"] = keys, values
                for part, stored in parts.items():
                    for kind, tensor in zip(("full",) if stored.full is not None else ("u", "v"), stored.tensors()):
                        tensors[f"{slot}/{index}/{part}/{kind}"] = tensor.contiguous().cpu()
                rows.append(
                    {
                        "name": anchor.name,
                        "owner": anchor.owner,
                        "agents": list(anchor.deltas),
                        "activations": anchor.activations,
                    }
                )
        metadata = {
            "kind": POOL_KIND,
            "version": str(POOL_VERSION),
            "identity": json.dumps(identity, sort_keys=True),
            "capacity": str(self.capacity),
            "window": str(self.window),
            "rank": "" if self.rank is None else str(self.rank),
            "heads": str(self.heads()),
            "layout": json.dumps(layout),
        }
        with atomic_open(path, "wb") as handle:
            handle.write(save(tensors, metadata=metadata))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, identity: dict, device: torch.device) -> AnchorPool:
        """A pool written by `save`; refused if not one or fitted on another model / tokenizer than `identity`."""
        metadata, tensors = _read_pool(path, device)
        if metadata.get("kind") != POOL_KIND:
            raise KvprofError(f"{path} is not a kvprof anchor pool; {POOL_FIX}.")
        if metadata.get("version") != str(POOL_VERSION):
            raise KvprofError(
                f"anchor pool {path} is in format {metadata.get('version')} (per-head factors over context-free "
                f"bases), not {POOL_VERSION}; refit it with kvprof fit-anchors."
            )
        fitted = _metadata_json(path, metadata, "identity")
        differs = sorted(key for key in identity if fitted.get(key) != identity[key])
        if differs:
            raise KvprofError(
                f"anchor pool {path} was fitted on another {' and '.join(differs)} ({fitted.get(differs[0])} vs "
                f"{identity[differs[0]]}); fit a pool for this model with kvprof fit-anchors."
            )
        sizes = {key: metadata.get(key, "") for key in ("capacity", "window", "rank")}
        if not all(value.isdigit() for key, value in sizes.items() if value or key != "rank"):
            raise KvprofError(f"anchor pool {path} has sizes {sizes} that are not whole numbers; {POOL_FIX}.")
        rank = int(sizes["rank"]) if sizes["rank"] else None
        pool = cls(int(sizes["capacity"]), int(sizes["window"]), rank)
        shapes = _PoolShapes(path, identity, rank, tensors)
        for slot, rows in _metadata_json(path, metadata, "layout").items():
            if not isinstance(rows, list):
                raise KvprofError(f"anchor pool {path} has slot {slot!r} that is not a list of anchors; {POOL_FIX}.")
            for index, row in enumerate(rows):
                head = f"{slot}/{index}"
                check_fields(row, ANCHOR_FIELDS, f"anchor pool {path}, anchor {head!r}", POOL_FIX)
                if not all(isinstance(agent, str) for agent in row["agents"]):
                    raise KvprofError(
                        f"anchor pool {path}, anchor {head!r} names agents that are not texts; {POOL_FIX}."
                    )
                anchor = Anchor(
                    row["name"], row["owner"], shapes.stored(f"{head}/base.k"), shapes.stored(f"{head}/base.v")
                )
                anchor.activations = row["activations"]
                for agent in row["agents"]:
                    anchor.deltas[agent] = (
                        shapes.stored(f"{head}/delta.{agent}.k"),
                        shapes.stored(f"{head}/delta.{agent}.v"),
                    )
                if len({part.length for part in anchor.stored()}) > 1:
                    raise KvprofError(
                        f"anchor pool {path}, anchor {head!r} has parts of different lengths; {POOL_FIX}."
                    )
                pool.slots.setdefault(slot, []).append(anchor)
        return pool


def _read_pool(path: str | Path, device: torch.device | str = "cpu") -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors of a safetensors file, refused in one sentence when it is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    require_file(Path(path), "anchor pool", POOL_FIX)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path), device=str(device))
    except (OSError, SafetensorError) as err:
        raise KvprofError(f"anchor pool {path} cannot be read ({err.__class__.__name__}); {POOL_FIX}.") from None
    return metadata, tensors


def _metadata_json(path: str | Path, metadata: dict[str, str], key: str) -> dict:
    """The JSON object a pool's metadata holds under `key`."""
    try:
        value = json.loads(metadata.get(key, ""))
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise KvprofError(f"anchor pool {path} has no JSON object as its {key}; {POOL_FIX}.")
    return value


class _PoolShapes:
    """A pool file's tensors, checked against the model's shape (`pool_shape`), its dtype and the pool's rank."""

    def __init__(self, path: str | Path, identity: dict, rank: int | None, tensors: dict[str, torch.Tensor]):
        self.path, self.rank, self.tensors = path, rank, tensors
        self.layers, self.heads, *dims = map(int, identity["shape"].split("x"))
        self.key_dim, self.value_dim = dims[0], dims[-1]
        self.dtype = identity["dtype"]

    def stored(self, prefix: str) -> Stored:
        """The `Stored` under `prefix` (a K side ".k" or a V side ".v"): full-dimensional without a rank, factors
        with one."""
        self.head_dim = self.key_dim if prefix.endswith(".k") else self.value_dim
        names = [f"{prefix}/full"] if self.rank is None else [f"{prefix}/u", f"{prefix}/v"]
        missing = [name for name in names if name not in self.tensors]
        if missing:
            raise KvprofError(f"anchor pool {self.path} lacks tensor {missing[0]!r}; {POOL_FIX}.")
        parts = [self.tensors[name] for name in names]
        if self.rank is None:
            full = parts[0]
            fits = full.dim() == 4 and (full.shape[0], full.shape[1], full.shape[3]) == (
                self.layers,
                self.heads,
                self.head_dim,
            )
            stored = Stored(full=full, heads=self.heads)
        else:
            u, v = parts
            fits = (
                u.dim() == v.dim() == 3
                and u.shape[0] == v.shape[0] == self.layers
                and u.shape[2] == v.shape[1] <= self.rank
                and v.shape[2] == self.heads * self.head_dim
            )
            stored = Stored(u=u, v=v, heads=self.heads)
        if not fits or any(str(part.dtype).removeprefix("torch.") != self.dtype for part in parts):
            raise KvprofError(
                f"anchor pool {self.path} holds tensor {names[0]!r} of shape {tuple(parts[0].shape)} and dtype "
                f"{parts[0].dtype}, which does not fit the model ({self.layers}x{self.heads}x{self.head_dim} there, "
                f"{self.dtype}) and rank {self.rank}; {POOL_FIX}."
            )
        return stored


def pool_digest(path: str | Path) -> str:
    """A digest of a pool file's tensors and metadata in canonical order (safetensors' bytes are not canonical)."""
    import hashlib

    metadata, tensors = _read_pool(path)
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for name, tensor in sorted(tensors.items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"


def mixed_delta(match: Match, target: str, layer: int, values: bool, src: torch.Tensor, out: torch.Tensor) -> None:
    """One layer's corrected K (`values=False`) or V into `out` (H_kv, L, D): src + Σ_n w_n·(Δ_target − Δ_source)_n,
    w per token; low-rank anchors in one fused GEMM (`kvprof.kernels.correction`)."""
    length = src.shape[-2]
    part = 1 if values else 0
    weights = match.token_weights(values, length)
    terms: list[tuple[torch.Tensor, Stored]] = []
    for row, anchor in zip(weights, match.anchors):
        if target != anchor.owner:
            terms.append((row, anchor.deltas[target][part]))
        if match.source != anchor.owner:
            assert match.source is not None
            terms.append((-row, anchor.deltas[match.source][part]))
    if not terms:
        out.copy_(src)
        return
    if any(stored.full is not None or (stored.rank or 0) > MAX_RANK for _, stored in terms):
        total = src.float().clone()
        for row, stored in terms:
            total += row[None, :, None] * stored.dense(length, slice(layer, layer + 1))[0]
        out.copy_(total.to(out.dtype))
        return
    rank = max(stored.rank or 0 for _, stored in terms)
    heads, head_dim = src.shape[0], src.shape[-1]
    u = torch.zeros(len(terms), heads, length, rank, dtype=src.dtype, device=src.device)
    v = torch.zeros(len(terms), heads, rank, head_dim, dtype=src.dtype, device=src.device)
    for index, (row, stored) in enumerate(terms):
        left, right = stored.head_factors(layer, length)
        keep = left.shape[-1]
        u[index, :, :, :keep] = (left.float() * row[None, :, None]).to(src.dtype)
        v[index, :, :keep] = right
    ones = torch.ones(len(terms), dtype=torch.float32, device=src.device)
    low_rank_correction(src.contiguous(), u, v, ones, out)

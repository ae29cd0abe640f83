"""Anchor pools: what the delta-correction policies (KVComm, KVCMAS, GraphFlow) know about how a shared segment's
K/V change with the context it is read in.

A shared segment of L tokens read by agent a after its own prefix has a cache C_a (per layer (H_kv, L, D)); the same
tokens encoded alone (context-free, positions 0..L−1) give the base B. Everything here lives in the segment's own
frame: keys rotated back to positions 0..L−1 (`kvprof.rope.rotate_keys`), so caches read at different positions
compare and subtract directly. Tensors are stacked over layers: (layers, H_kv, L, D).

- `Stored`: one (layers, H_kv, L, D) tensor kept either full-dimensional (KVComm) or as rank-r truncated-SVD factors
  per (layer, head), Z ≈ U·V with U = U_r·Σ_r (layers, H_kv, L, r) and V = R_rᵀ (layers, H_kv, r, D) (KVCMAS). A
  prefix of the rows is a prefix of U's rows, so truncating to a shorter segment costs nothing.
- `Anchor`: one observed segment of a placeholder slot: its base B and, per agent that computed it densely, its delta
  Δ_a = C_a − B; with an activation count.
- `AnchorPool`: the anchors of every slot (a slot is a placeholder of the workflow, e.g. the planner's first output),
  bounded per slot, eviction of the least-activated of the oldest `window` anchors (KVComm's rule); `match` weighs a
  candidate against a slot's anchors: softmax over −‖X_V − B_V‖ (values of the corrected layers, anchors truncated
  to the candidate's length, as the public KVComm code does), with the normalized entropy H(w)/log N of the weights
  as the confidence the gate compares with its threshold (accept below it); `correction` mixes the anchors'
  deltas with those weights.
- Saving and loading (`save` / `load`): safetensors for the tensors, a JSON header for the layout and the identity
  of the model and tokenizer the pool was fitted on, checked on load.

Memory of a pool (`nbytes`, equal to its tensors' bytes): per stored matrix, layers·H_kv·L·D elements full-dimensional
or layers·H_kv·r_eff·(L + D) as factors, r_eff = min(r, L, D); a pool of V anchors per slot for N agents holds
(1 + N) such matrices for K and for V per anchor: O(V·N·L·D) → O(V·N·r·(L + D)).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvprof.errors import KvprofError
from kvprof.fileio import atomic_open
from kvprof.kernels.attention import MAX_RANK
from kvprof.kernels.correction import low_rank_correction

POOL_KIND = "kvprof.anchor-pool"
POOL_VERSION = 1


@dataclass
class Stored:
    """One (layers, H_kv, L, D) tensor, full-dimensional (`full`) or as factors (`u` (layers, H_kv, L, r),
    `v` (layers, H_kv, r, D))."""

    full: torch.Tensor | None = None
    u: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, rank: int | None) -> Stored:
        """`tensor` (layers, H_kv, L, D) kept whole (`rank` None) or as its rank-min(rank, L, D) truncated SVD per
        (layer, head), computed in float32 and stored in the tensor's dtype."""
        if rank is None:
            return cls(full=tensor.clone())
        keep = min(rank, tensor.shape[-2], tensor.shape[-1])
        left, sigma, right = torch.linalg.svd(tensor.float(), full_matrices=False)
        u = (left[..., :keep] * sigma[..., None, :keep]).to(tensor.dtype)
        return cls(u=u.contiguous(), v=right[..., :keep, :].to(tensor.dtype).contiguous())

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
        return torch.matmul(self.u[layers, :, :length].float(), self.v[layers].float())


def stored_bytes(layers: int, heads: int, length: int, head_dim: int, rank: int | None, itemsize: int) -> int:
    """The formula for one `Stored` matrix: layers·H·L·D elements full-dimensional, layers·H·r_eff·(L + D) as
    factors with r_eff = min(rank, L, D)."""
    if rank is None:
        return layers * heads * length * head_dim * itemsize
    keep = min(rank, length, head_dim)
    return layers * heads * keep * (length + head_dim) * itemsize


@dataclass
class Anchor:
    """One observed segment of a slot. name: where it was observed (trajectory and segment); base_keys/base_values:
    its context-free K/V in its own frame; deltas: agent → (ΔK, ΔV), C_agent − B; activations: how often a match
    relied on it."""

    name: str
    base_keys: Stored
    base_values: Stored
    deltas: dict[str, tuple[Stored, Stored]] = field(default_factory=dict)
    activations: int = 0

    @property
    def length(self) -> int:
        return self.base_keys.length

    def stored(self) -> list[Stored]:
        return [self.base_keys, self.base_values] + [part for pair in self.deltas.values() for part in pair]


@dataclass
class Match:
    """A candidate weighed against a slot's eligible anchors: `weights` (N,) float32, softmax over −distance;
    `entropy`: H(w)/log N in [0, 1] (1 when fewer than two anchors: no evidence to prefer one)."""

    anchors: list[Anchor]
    weights: torch.Tensor
    entropy: float

    def confident(self, threshold: float) -> bool:
        """The gate: at least two anchors and a normalized entropy below `threshold` (peaked weights); threshold 0
        accepts nothing."""
        return len(self.anchors) >= 2 and self.entropy < threshold


def normalized_entropy(weights: torch.Tensor) -> float:
    """H(w)/log N of a probability vector (N,), in [0, 1]; 1.0 for N < 2."""
    if weights.numel() < 2:
        return 1.0
    probabilities = weights.double().clamp_min(1e-300)
    entropy = -(weights.double() * probabilities.log()).sum()
    return float(entropy / math.log(weights.numel()))


class AnchorPool:
    """Anchors per slot (see module docstring). capacity: anchors kept per slot (V); window: eviction looks at the
    oldest `window` anchors and drops the least activated; rank: factor rank (None: full-dimensional)."""

    def __init__(self, capacity: int, window: int, rank: int | None):
        self.capacity, self.window, self.rank = capacity, window, rank
        self.slots: dict[str, list[Anchor]] = {}

    def anchor(self, slot: str, name: str) -> Anchor | None:
        return next((a for a in self.slots.get(slot, []) if a.name == name), None)

    def add(self, slot: str, name: str, base_keys: torch.Tensor, base_values: torch.Tensor) -> Anchor:
        """A new anchor for a segment (base K/V (layers, H_kv, L, D) in its frame), evicting one when the slot is
        full."""
        anchors = self.slots.setdefault(slot, [])
        if len(anchors) >= self.capacity:
            oldest = anchors[: self.window]
            anchors.remove(min(oldest, key=lambda a: a.activations))
        anchor = Anchor(name, Stored.of(base_keys, self.rank), Stored.of(base_values, self.rank))
        anchors.append(anchor)
        return anchor

    def add_delta(self, anchor: Anchor, agent: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Agent `agent`'s dense K/V of the anchor's segment (layers, H_kv, L, D), in its frame: kept as its delta."""
        delta_keys = keys.float() - anchor.base_keys.dense(anchor.length)
        delta_values = values.float() - anchor.base_values.dense(anchor.length)
        dtype = keys.dtype
        anchor.deltas[agent] = (
            Stored.of(delta_keys.to(dtype), self.rank),
            Stored.of(delta_values.to(dtype), self.rank),
        )

    def eligible(self, slot: str, length: int, agents: tuple[str, ...], exclude: str = "") -> list[Anchor]:
        """The slot's anchors at least `length` long with a delta for every agent in `agents`."""
        return [
            a
            for a in self.slots.get(slot, [])
            if a.length >= length and a.name != exclude and all(agent in a.deltas for agent in agents)
        ]

    def match(
        self, slot: str, values: torch.Tensor, agents: tuple[str, ...], temperature: float, exclude: str = ""
    ) -> Match:
        """Weigh a candidate segment (its values on layers 1.., (layers − 1, H_kv, L, D)) against the slot's eligible
        anchors' base values on the same layers and first L tokens: w = softmax(−‖X − B_n‖ / temperature)."""
        length = values.shape[-2]
        anchors = self.eligible(slot, length, agents, exclude)
        if not anchors:
            return Match([], torch.zeros(0), 1.0)
        candidate = values.float()
        distances = torch.stack(
            [torch.linalg.vector_norm(candidate - a.base_values.dense(length, slice(1, None))) for a in anchors]
        )
        weights = torch.softmax(-distances / temperature, dim=0)
        return Match(anchors, weights, normalized_entropy(weights))

    @staticmethod
    def activate(match: Match, top_p: float = 0.9) -> None:
        """Count an accepted match for the anchors that carry the top `top_p` of its weight."""
        order = torch.argsort(match.weights, descending=True).tolist()
        mass = 0.0
        for index in order:
            match.anchors[index].activations += 1
            mass += float(match.weights[index])
            if mass >= top_p:
                break

    def nbytes(self) -> int:
        """Bytes of the pool's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def analytic_bytes(self, layers: int, heads: int, head_dim: int, itemsize: int) -> int:
        """The formula (`stored_bytes`): per anchor, K and V of its base and of each delta."""
        return sum(
            2 * (1 + len(anchor.deltas)) * stored_bytes(layers, heads, anchor.length, head_dim, self.rank, itemsize)
            for anchors in self.slots.values()
            for anchor in anchors
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for anchors in self.slots.values() for a in anchors for part in a.stored() for t in part.tensors()]

    # ------------------------------------------------------------------------------------------ files

    def save(self, path: str | Path, identity: dict) -> Path:
        """Write the pool: safetensors at `path` (tensors by slot/anchor/part), its layout and `identity` (the model
        and tokenizer it was fitted on) in the file's metadata. Atomic."""
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
                rows.append({"name": anchor.name, "agents": list(anchor.deltas), "activations": anchor.activations})
        metadata = {
            "kind": POOL_KIND,
            "version": str(POOL_VERSION),
            "identity": json.dumps(identity, sort_keys=True),
            "capacity": str(self.capacity),
            "window": str(self.window),
            "rank": "" if self.rank is None else str(self.rank),
            "layout": json.dumps(layout),
        }
        with atomic_open(path, "wb") as handle:
            handle.write(save(tensors, metadata=metadata))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, identity: dict, device: torch.device) -> AnchorPool:
        """A pool written by `save`, refused with one sentence when the file is not one or was fitted on another
        model or tokenizer than `identity` names."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file, safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
            tensors = load_file(str(path), device=str(device))
        except (OSError, SafetensorError) as err:
            raise KvprofError(
                f"anchor pool {path} cannot be read ({err.__class__.__name__}); pass a file written by kvprof "
                "fit-anchors."
            ) from None
        if metadata.get("kind") != POOL_KIND:
            raise KvprofError(f"{path} is not a kvprof anchor pool; pass a file written by kvprof fit-anchors.")
        fitted = json.loads(metadata["identity"])
        differs = sorted(key for key in identity if fitted.get(key) != identity[key])
        if differs:
            raise KvprofError(
                f"anchor pool {path} was fitted on another {' and '.join(differs)} ({fitted.get(differs[0])} vs "
                f"{identity[differs[0]]}); fit a pool for this model with kvprof fit-anchors."
            )
        rank = int(metadata["rank"]) if metadata["rank"] else None
        pool = cls(int(metadata["capacity"]), int(metadata["window"]), rank)

        def stored(prefix: str) -> Stored:
            if f"{prefix}/full" in tensors:
                return Stored(full=tensors[f"{prefix}/full"])
            return Stored(u=tensors[f"{prefix}/u"], v=tensors[f"{prefix}/v"])

        for slot, rows in json.loads(metadata["layout"]).items():
            for index, row in enumerate(rows):
                head = f"{slot}/{index}"
                anchor = Anchor(row["name"], stored(f"{head}/base.k"), stored(f"{head}/base.v"))
                anchor.activations = row["activations"]
                for agent in row["agents"]:
                    anchor.deltas[agent] = (stored(f"{head}/delta.{agent}.k"), stored(f"{head}/delta.{agent}.v"))
                pool.slots.setdefault(slot, []).append(anchor)
        return pool


def pool_digest(path: str | Path) -> str:
    """A digest of a pool file's content (its tensors by name and its metadata, in a canonical order): the file's
    bytes are not canonical (safetensors writes its metadata in no fixed order)."""
    import hashlib

    from safetensors.torch import load_file, safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for name, tensor in sorted(load_file(str(path)).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"


def mixed_delta(
    match: Match, target: str, source: str | None, layer: int, values: bool, src: torch.Tensor, out: torch.Tensor
) -> None:
    """The corrected K (values=False) or V of one layer into `out` (H_kv, L, D): src + Σ_n w_n·(Δ_target − Δ_source)_n
    on the first L rows, Δ_source omitted when `source` is None (the reference is the base). Low-rank anchors go
    through the fused correction kernel (`kvprof.kernels.correction`) as one GEMM over the concatenated factors
    (ranks zero-padded to the largest); full-dimensional ones are summed directly."""
    length = src.shape[-2]
    part = 1 if values else 0
    terms: list[tuple[float, Stored]] = []
    for weight, anchor in zip(match.weights.tolist(), match.anchors):
        terms.append((weight, anchor.deltas[target][part]))
        if source is not None:
            terms.append((-weight, anchor.deltas[source][part]))
    if any(stored.full is not None or (stored.rank or 0) > MAX_RANK for _, stored in terms):
        total = src.float().clone()
        for weight, stored in terms:
            total += weight * stored.dense(length, slice(layer, layer + 1))[0]
        out.copy_(total.to(out.dtype))
        return
    rank = max(stored.rank or 0 for _, stored in terms)
    heads, head_dim = src.shape[0], src.shape[-1]
    u = torch.zeros(len(terms), heads, length, rank, dtype=src.dtype, device=src.device)
    v = torch.zeros(len(terms), heads, rank, head_dim, dtype=src.dtype, device=src.device)
    for index, (_, stored) in enumerate(terms):
        assert stored.u is not None and stored.v is not None
        keep = stored.u.shape[-1]
        u[index, :, :, :keep] = stored.u[layer, :, :length]
        v[index, :, :keep] = stored.v[layer]
    weights = torch.tensor([weight for weight, _ in terms], dtype=torch.float32, device=src.device)
    low_rank_correction(src.contiguous(), u, v, weights, out)

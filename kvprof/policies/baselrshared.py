"""BaseLRShared (LRAgent): one shared base cache and one shared LR cache, for adapters that share A.

With a shared down-projection A (only B differs per agent), the LR cache X·A is the same object for every agent:
whoever processes a token stores X_i·W0 and X_i·A once, and agent j applies its own B_j at attention time. No LR
prefill; only new tokens are computed. Approximate (X_i carries agent i's adapter effects). Refuses adapters whose
A differ. Paper: LRAgent (BaseLRShared).
"""

from __future__ import annotations

from kvprof.claims.papers import LRAGENT, LRAGENT_SETTING
from kvprof.claims.types import Published
from kvprof.errors import KvprofError
from kvprof.model.lora import unshared_down_projections
from kvprof.model.runtime import Runtime
from kvprof.policies.baseshared import LRAGENT_MEMORY
from kvprof.policies.prelrshared import PreLRShared

SHARED = "shared"


class BaseLRShared(PreLRShared):
    name = "baselrshared"
    family = "LRAgent"
    paper = f"{LRAGENT}, BaseLRShared"
    published = (
        Published(
            LRAGENT, "main results, accuracy", LRAGENT_SETTING, "mean accuracy drop ≤ 1.5 points against NonShared"
        ),
        Published(
            LRAGENT,
            "main results, latency and throughput",
            LRAGENT_SETTING,
            "TTFT up to 4.44× lower than NonShared; throughput up to 2.46× with Flash-LoRA-Attention",
        ),
        LRAGENT_MEMORY,
    )

    def check(self, runtime: Runtime) -> None:
        super().check(runtime)
        names = runtime.agents.spec.names
        unshared = unshared_down_projections(runtime.splits, names)
        if unshared:
            shown = ", ".join(unshared[:3]) + (f" and {len(unshared) - 3} more" if len(unshared) > 3 else "")
            raise KvprofError(
                "policy baselrshared needs adapters that share their down-projection A on every cached projection "
                f"they adapt (only B differs), but the adapters of {', '.join(names)} differ on {shown}; use "
                "adapters trained with a shared A there, or policy prelrshared."
            )

    def lr_name(self, agent: str) -> str:
        return SHARED

    def lr_caches(self, agent: str) -> dict[str, str]:
        return {SHARED: agent}  # every agent's A is the same: the acting agent's forward computes X·A once

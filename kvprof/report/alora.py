"""Plain LoRA agents under each LoRA-family policy beside their aLoRA twins under ALoRAShared, FullShared and
NonShared, each against its own dense run: approximate sharing, or retraining as aLoRA and sharing exactly."""

from __future__ import annotations

from kvprof.report.tables import TableData, cell
from kvprof.results.replay import ReplayResult, summary_of

LORA_FAMILIES = ("baseline", "LRAgent", "PReCache")


def comparison_rows(lora: ReplayResult | dict, alora: ReplayResult | dict) -> list[dict]:
    """One row per (agents, policy): online accuracy, KL, K error, TTFT × (measured and FLOP-implied), KV blocks ÷
    dense. `lora`, `alora`: the two replays' results, same tasks."""
    rows = []
    for agents, record in (("LoRA", ReplayResult.of(lora)), ("aLoRA", ReplayResult.of(alora))):
        online = record.online or {}
        dense = {
            "agents": agents,
            "policy": "dense (reference)",
            "accuracy": online.get("dense", {}).get("accuracy"),
            "kl": 0.0,
            "k_error": 0.0,
            "ttft_speedup": 1.0,
            "flops_speedup": 1.0,
            "kv_memory": 1.0,
            "prefilled": summary_of("dense", record.dense).prefilled,
        }
        rows.append(dense)
        for label, run in record.policies.items():
            if agents == "LoRA" and run.family not in LORA_FAMILIES:
                continue
            summary = summary_of(label, run)
            rows.append(
                {
                    "agents": agents,
                    "policy": label,
                    "accuracy": online.get(label, {}).get("accuracy"),
                    "kl": summary.kl,
                    "k_error": summary.k_error,
                    "ttft_speedup": summary.ttft_speedup,
                    "flops_speedup": summary.ttft_speedup_implied_flops,
                    "kv_memory": summary.kv_block_ratio,
                    "prefilled": summary.prefilled,
                }
            )
    return rows


def comparison_table(rows: list[dict], title: str) -> TableData:
    """`comparison_rows` as a table."""
    table = TableData(
        title,
        ["agents", "policy", "online accuracy", "KL", "K error", "TTFT ×", "TTFT × (FLOPs)", "KV memory ×"]
        + ["prefilled"],
        caption="each replay against its own dense run (NonShared's caches and outputs); TTFT × measured, and as "
        "the FLOPs imply; KV memory: peak KV blocks over the dense run's.",
    )
    for row in rows:
        table.add_row(
            row["agents"],
            row["policy"],
            cell(row["accuracy"], ".0%"),
            f"{row['kl']:.2g}",
            f"{row['k_error']:.3f}",
            cell(row["ttft_speedup"], ".2f"),
            cell(row["flops_speedup"], ".2f"),
            cell(row["kv_memory"], ".2f"),
            row["prefilled"],
        )
    return table

"""The question a team with LoRA agents faces: keep them and share caches approximately (the LoRA-family policies),
or retrain them as Activated LoRA (peft's aLoRA) and share exactly. Two replays of the same tasks side by side:
plain LoRA agents under each LoRA-family policy, and their aLoRA twins under ALoRAShared, FullShared and NonShared,
each against its own dense run."""

from __future__ import annotations

from kvprof.report.tables import TableData, cell

LORA_FAMILIES = ("baseline", "LRAgent", "PReCache")


def comparison_rows(lora: dict, alora: dict) -> list[dict]:
    """One row per (agents, policy): online accuracy, KL and K error against that replay's dense run, TTFT speed-up
    (measured and FLOP-implied) and the KV memory in blocks relative to the dense run. `lora`, `alora`: replay
    results (`replay.json`) of the plain LoRA agents and of their aLoRA twins, on the same tasks."""
    rows = []
    for agents, record in (("LoRA", lora), ("aLoRA", alora)):
        online = record.get("online", {})
        dense = {
            "agents": agents,
            "policy": "dense (reference)",
            "accuracy": online.get("dense", {}).get("accuracy"),
            "kl": 0.0,
            "k_error": 0.0,
            "ttft_speedup": 1.0,
            "flops_speedup": 1.0,
            "kv_memory": 1.0,
            "prefilled": record["dense"]["summary"]["prefilled"],
        }
        rows.append(dense)
        for label, entry in record["policies"].items():
            if agents == "LoRA" and entry["family"] not in LORA_FAMILIES:
                continue
            summary = entry["summary"]
            rows.append(
                {
                    "agents": agents,
                    "policy": label,
                    "accuracy": online.get(label, {}).get("accuracy"),
                    "kl": summary["kl"],
                    "k_error": summary["k_error"],
                    "ttft_speedup": summary.get("ttft_speedup"),
                    "flops_speedup": summary.get("ttft_speedup_implied_flops"),
                    "kv_memory": summary.get("kv_block_ratio"),
                    "prefilled": summary["prefilled"],
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

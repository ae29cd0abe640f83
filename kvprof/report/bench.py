"""Tables and figures of a `kvprof bench` result (the JSON it writes), for the terminal and the dashboard."""

from __future__ import annotations

from kvprof.report.figures import line_figure
from kvprof.report.html import Section
from kvprof.report.tables import TableData


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def results_table(result: dict) -> TableData:
    """One row per (mode, L, r, method); ratios within a case; % of peak only for devices with known peaks."""
    rows, peak_known = result["results"], result["peak"] is not None
    peak_columns = ["% peak FLOP", "% peak BW"] if peak_known else []
    table = TableData(
        title=f"kvprof bench on {result['device']} ({result['dtype']}), median of repeats",
        columns=["mode", "L", "r", "method", "median ms", "TFLOP/s", "GB/s", *peak_columns, "vs naive", "vs sdpa"],
        caption="vs naive = t_naive / t (speed-up over expanding V); vs sdpa = t_sdpa / t (throughput relative to "
        "attention without LoRA). FLOPs and bytes are analytic minimums.",
    )
    for row in rows:
        peaks = [_fraction(row["fraction_of_peak_flops"]), _fraction(row["fraction_of_peak_bandwidth"])]
        table.add_row(
            row["mode"],
            row["seq_len"],
            row["rank"],
            row["method"],
            f"{row['median_ms']:.3f}",
            f"{row['tflops']:.3f}",
            f"{row['gbps']:.1f}",
            *(peaks if peak_known else []),
            f"{row['speedup_vs_naive']:.2f}×",
            f"{row['throughput_vs_sdpa']:.2f}×",
        )
    return table


def figures(rows: list[dict]) -> list:
    """Median time against L, one figure per (mode, rank), one line per method."""
    result = []
    for mode, rank in dict.fromkeys((row["mode"], row["rank"]) for row in rows):
        chosen = [row for row in rows if row["mode"] == mode and row["rank"] == rank]
        lengths = list(dict.fromkeys(row["seq_len"] for row in chosen))
        series = {
            method: [
                next(row["median_ms"] for row in chosen if row["seq_len"] == length and row["method"] == method)
                for length in lengths
            ]
            for method in dict.fromkeys(row["method"] for row in chosen)
        }
        result.append(line_figure(lengths, series, f"{mode}, r = {rank}", "L (tokens)", "median time (ms)", log_y=True))
    return result


def sections(result: dict) -> list[Section]:
    """The bench dashboard section, from the JSON result."""
    return [
        Section(
            "Flash-LoRA-Attention vs naive expansion vs plain SDPA",
            text=[f"{method}: {description}" for method, description in result["implementations"].items()],
            tables=[results_table(result)],
            figures=figures(result["results"]),
        )
    ]

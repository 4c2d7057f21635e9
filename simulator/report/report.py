"""Human and machine output of results: a short rich table, or exactly one JSON object."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from csbp.simulator.report.result import Result


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: turn them into null so every consumer can parse the output."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dumps(obj: Any) -> str:
    """Deterministic JSON: same inputs give byte-identical text."""
    return json.dumps(_clean(obj), indent=2, sort_keys=True)


def print_json(obj: Any) -> None:
    sys.stdout.write(dumps(obj) + "\n")


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def result_table(result: Result, title: str | None = None) -> Table:
    plan = result.plan
    table = Table(title=title or f"{result.model} · {plan.get('label', '')} ({plan.get('kind', '')}) · "
                  f"{result.gpus} x {result.hardware}", show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    if not result.feasible:
        table.add_row("feasible", f"[red]no[/red] — {result.reason}")
    table.add_row("step time", fmt_time(result.step_time_s))
    table.add_row("tokens/s (context)" if result.objective_label else "tokens/s",
                  f"{result.tokens_per_s:,.0f}" if result.tokens_per_s else "-")
    table.add_row("tokens/s per GPU", f"{result.tokens_per_s_per_gpu:,.0f}" if result.tokens_per_s_per_gpu else "-")
    table.add_row("model TFLOP/s per GPU (Megatron)",
                  f"{result.model_tflops_per_gpu:,.1f}" if result.model_tflops_per_gpu else "-")
    if result.objective_label:  # what the objective's users count (implementation.md 15)
        table.add_row(result.objective_label,
                      f"{result.objective_tokens_per_s:,.0f}" if result.objective_tokens_per_s else "-")
    table.add_row("peak memory / GPU", f"{result.peak_memory_gib:.1f} GiB" if result.peak_memory_gib else "-")
    if result.outside_allocator_gib:  # in the peak, not in max_memory_allocated (DeepEP's buffers)
        table.add_row("  of which outside the allocator", f"{result.outside_allocator_gib:.2f} GiB")
    if result.memory_per_rank_gib:
        table.add_row("memory per rank", " ".join(f"{m:.1f}" for m in result.memory_per_rank_gib) + " GiB")
    table.add_row("attention traffic / GPU", f"{result.attention_traffic_gib_per_gpu:.2f} GiB")
    table.add_row("exposed communication", fmt_time(result.exposed_comm_s))
    if result.stretched_compute_s:
        table.add_row("compute slowed by overlap", fmt_time(result.stretched_compute_s))
    table.add_row("implementation", result.implementation)
    if result.mfu is not None:
        table.add_row("MFU", f"{result.mfu:.1%}")
    for phase, seconds in result.phases_s.items():
        table.add_row(f"  {phase}", fmt_time(seconds))
    return table


def print_result(result: Result) -> None:
    console = Console()
    console.print(result_table(result))
    for note in result.notes:
        console.print(f"[dim]note: {note}[/dim]")

"""Printing for the CLI: rich tables when ``rich`` is installed, aligned plain text otherwise.

Letters: N nodes, R rails, V waves.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from megatron_railwave.planner import PathPlan
from megatron_railwave.traffic import TrafficStats

__all__ = ["print_table", "print_text", "print_rail_egress", "print_waves", "print_descriptors"]

MiB = 1 << 20

try:  # rich is an optional dependency (the "tools" extra).
    from rich.console import Console
    from rich.table import Table

    # Piped output (tests, logs) would wrap at 80 columns; tables need more.
    _CONSOLE: Console | None = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
except ImportError:  # pragma: no cover - exercised only without rich
    _CONSOLE = None


def print_text(text: str) -> None:
    if _CONSOLE is not None:
        _CONSOLE.print(text, markup=False)
    else:  # pragma: no cover
        print(text)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """One table; numbers right-aligned, the first column left-aligned."""
    cells = [[_fmt(v) for v in row] for row in rows]
    if _CONSOLE is not None:
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        for row in cells:
            table.add_row(*row)
        _CONSOLE.print(table)
        return
    widths = [
        max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)
    ]  # pragma: no cover
    print(title)  # pragma: no cover
    for row in [list(headers)] + cells:  # pragma: no cover
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def print_rail_egress(plan: PathPlan, *, record_bytes: int) -> None:
    """Remote egress of every (node, rail) in MiB, with each node's max/mean over its healthy
    rails."""
    topo = plan.topology
    load_NRN = plan.rail_load_NRN().clone()
    for node in range(topo.num_nodes):
        load_NRN[node, :, node] = 0  # the local node needs no rail
    egress_NR = load_NRN.sum(dim=-1).double() * record_bytes / MiB
    used = sorted(set(topo.rail_of_gpu))
    rows = []
    for node in range(topo.num_nodes):
        healthy = [r for r in used if topo.rail_healthy(node, r)]
        vals = [float(egress_NR[node, r]) for r in healthy]
        mean = sum(vals) / len(vals) if vals else 0.0
        ratio = max(vals) / mean if mean > 0 else 1.0
        cells = [
            f"{egress_NR[node, r]:.1f}" if topo.rail_healthy(node, r) else "failed" for r in used
        ]
        rows.append([f"node {node}", *cells, ratio])
    print_table(
        f"{plan.path}: remote egress per rail (MiB)",
        ["", *[f"rail {r}" for r in used], "max/mean"],
        rows,
    )


def print_waves(plan: PathPlan, *, max_pairs: int = 16) -> None:
    """The sending windows (NATIVE, RAIL) or waves (PERM, JOINT) as 's->d' lists."""
    sched = plan.schedule
    chunks = f", each in {plan.chunks} rail chunks" if plan.chunks > 1 else ""
    lines = [
        f"{plan.path}: {sched.num_waves} {'wave' if plan.path.waved else 'window'}(s){chunks}, "
        f"schedule {sched.kind}, max fan-in {sched.max_fanin()}"
    ]
    for v, wave in enumerate(sched.waves):
        pairs = [f"{s}->{d}" for s, d in wave]
        more = f" ... (+{len(pairs) - max_pairs})" if len(pairs) > max_pairs else ""
        lines.append(f"  {v}: " + " ".join(pairs[:max_pairs]) + more)
    print_text("\n".join(lines))


def print_descriptors(rows: Sequence[tuple[str, TrafficStats, int, float]]) -> None:
    """One row per path: (path name, stats, relayed records, planning ms)."""
    print_table(
        "descriptors (B per GPU; rho_g source-rail imbalance; kappa receiver concentration)",
        [
            "path",
            "B mean MiB",
            "B max MiB",
            "rho_g",
            "kappa",
            "log2(B/ref)",
            "(rho-1)/s",
            "(kappa-1)/s",
            "relayed",
            "plan ms",
        ],
        [
            [
                name,
                st.B_mean_bytes / MiB,
                st.B_max_bytes / MiB,
                st.rho_g,
                st.kappa,
                *st.coords,
                relayed,
                ms,
            ]
            for name, st, relayed, ms in rows
        ],
    )

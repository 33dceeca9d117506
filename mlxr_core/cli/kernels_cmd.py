"""``mlxr kernels``: every op's kernel backends on this machine, whether each can run, and why not.

The same decision ``mlxr serve`` makes when it binds a model's kernels (see
:mod:`mlxr_core.kernels`), asked of every backend at once for one context: this machine's device,
an activation dtype and the attention shapes given as options (a Llama-3-8B-like 32/8 heads of 128
by default). The backend ``auto`` would take is marked. Only ``mlx.core`` is imported (for the
device) and the backends' modules (for their checks); no model graph.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mlxr_core.cli.commands import Subparsers

DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_parser(subparsers: Subparsers) -> None:
    """Add the ``kernels`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "kernels",
        help="list kernel backends per op: supported here or why not",
        description=(
            "For this machine, list every op's kernel backends (by priority) with supported / not "
            "supported and the reasons, and mark the one `auto` would choose. Swap one in a "
            "server config with `kernels: {OP: BACKEND}` (globally or per model)."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES,
        help="activation dtype to check (auto: bfloat16 on a GPU, float32 on CPU)",
    )
    parser.add_argument("--head-dim", type=int, default=128, metavar="D", help="default: 128")
    parser.add_argument("--heads", type=int, default=32, metavar="N", help="query heads (32)")
    parser.add_argument("--kv-heads", type=int, default=8, metavar="N", help="key/value heads (8)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``mlxr kernels``."""
    from mlxr_core.kernels import current_platform, kernel_report
    from mlxr_core.plugins import load_plugins

    device, platform = current_platform()
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "gpu" else "float32")
    shapes = {
        "head_dim": args.head_dim,
        "n_heads": args.heads,
        "n_kv_heads": args.kv_heads,
        "rope_dims": args.head_dim,
        "masks": ("causal",),
    }
    registry = load_plugins(strict=False).registries.kernels
    rows = kernel_report(registry, dtype=dtype, shapes=shapes, device=device, platform=platform)
    context = {"device": device, "platform": platform, "dtype": dtype, "shapes": {
        **shapes, "masks": list(shapes["masks"])}}
    if args.json:
        print(json.dumps({"context": context, "backends": rows}, indent=2))
    else:
        print_table(rows, context)
    return 0


def print_table(rows: list[dict[str, Any]], context: dict[str, Any]) -> None:
    """Print ``rows`` as a rich table, one line per (op, backend)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    shapes = context["shapes"]
    console = Console(soft_wrap=False)
    table = Table(
        title=(
            f"mlxr kernels: {context['device']} ({context['platform']}), {context['dtype']}, "
            f"{shapes['n_heads']}/{shapes['n_kv_heads']} heads of {shapes['head_dim']}"
        ),
        title_justify="left",
    )
    table.add_column("op", style="bold", no_wrap=True)
    table.add_column("backend", no_wrap=True)
    table.add_column("priority", justify="right")
    table.add_column("here", no_wrap=True)
    table.add_column("why not / what it does")
    previous = None
    for row in rows:
        here = "[green]auto[/]" if row["auto"] else (
            "[green]yes[/]" if row["supported"] else "[red]no[/]"
        )
        detail = "; ".join(row["reasons"]) if row["reasons"] else row["summary"]
        table.add_row(
            escape(row["op"]) if row["op"] != previous else "",
            escape(row["backend"]),
            str(row["priority"]),
            here,
            escape(detail),
        )
        previous = row["op"]
    console.print(table)
    console.print("Set one with `kernels: {OP: BACKEND}` in a server config (or per model).")

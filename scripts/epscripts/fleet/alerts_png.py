"""Draw the fleet matrix through one fault from what Prometheus recorded.

    scripts/fleet-alerts-png [--in docs/fleet-alerts.json] [--out docs/fleet-alerts-matrix.png]
    scripts/fleet-alerts-png --table     # the run as docs/operations.md's table

Reads the `matrix` that scripts/fleet-alerts saved (a query_range of every node's state of
every API server: 0 in service, 2 out of service) and draws one strip per API server: a row
per node, time across, the fault and its undoing marked, each alert's firing marked on its
strip. Needs matplotlib (`.venv/bin/pip install -e '.[docs]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from epscripts.fleet.nodes import repo_root


def table(doc: dict[str, Any]) -> str:
    """The run as the markdown table of docs/operations.md (API servers by name)."""
    api = {v: k for k, v in doc["api"].items()}

    def name(k: str) -> str:
        for ip, a in api.items():
            k = k.replace(f"upstream={ip}", f"upstream={a}")
        return k.replace("Extractedprism", "")

    rows = ["| phase | expected alert | fired (s after the fault) | resolved (s after undoing "
            "it) | other alerts that fired | pending only, never fired |",
            "|---|---|---|---|---|---|"]
    for p in doc["phases"]:
        exp = p["expect"]
        rec = p["alerts"].get(exp, {}) if exp else {}
        fired = [f"{name(k)} {v['firing']:.0f} s" for k, v in p["alerts"].items()
                 if "firing" in v and k != exp]
        pending = Counter(name(k).split("{")[0] for k, v in p["alerts"].items()
                          if "firing" not in v)
        rows.append(
            f"| {p['phase']} (held {p['held_s']:.0f} s) | {name(exp) if exp else 'none'} | "
            f"{rec.get('firing', 'not fired') if exp else '—'} | "
            f"{rec.get('resolved', '—') if exp else '—'} | {'; '.join(fired) or 'none'} | "
            f"{', '.join(f'{n} x{c}' for n, c in sorted(pending.items())) or 'none'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/fleet-alerts-png",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--in", dest="src", default=str(repo_root() / "docs" / "fleet-alerts.json"))
    p.add_argument("--out", default=str(repo_root() / "docs" / "fleet-alerts-matrix.png"))
    p.add_argument("--table", action="store_true",
                   help="print the run as a markdown table instead of drawing")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.src).read_text())))
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    doc = json.loads(Path(args.src).read_text())
    ph: dict[str, Any] = next(x for x in doc["phases"] if x.get("matrix"))
    t0 = ph["t_fault"]
    ups = sorted({s["metric"]["upstream"] for s in ph["matrix"]})
    nodes = sorted({s["metric"]["node"] for s in ph["matrix"]}, key=lambda n: int(n[1:]))
    times = sorted({float(v[0]) for s in ph["matrix"] for v in s["values"]})
    col = {t: i for i, t in enumerate(times)}
    fig, axes = plt.subplots(len(ups), 1, figsize=(10, 1.2 + 0.09 * len(nodes) * len(ups)),
                             sharex=True, squeeze=False)
    cmap = ListedColormap(["#2e9e44", "#f2c12e", "#d43d2f", "#dddddd"])
    extent = (times[0] - t0, times[-1] - t0, len(nodes), 0)
    for ax, up in zip((a[0] for a in axes), ups, strict=True):
        grid = [[3.0] * len(times) for _ in nodes]  # no sample: grey
        for s in ph["matrix"]:
            if s["metric"]["upstream"] != up:
                continue
            row = nodes.index(s["metric"]["node"])
            for t, v in s["values"]:
                grid[row][col[float(t)]] = float(v)
        ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=3, interpolation="nearest",
                  extent=extent)
        ax.set_ylabel(f"{up}\nnodes", fontsize=8)
        ax.set_yticks([])
        ax.axvline(0, color="black", lw=1)
        ax.axvline(ph["t_undo"] - t0, color="black", lw=1, ls="--")
        for name, rec in ph["alerts"].items():
            if up in name and "firing" in rec:
                ax.axvline(rec["firing"], color="blue", lw=1.5)
                ax.text(rec["firing"], 0, " " + name.split("{")[0].replace("Extractedprism", ""),
                        color="blue", fontsize=7, va="top")
    axes[-1][0].set_xlabel(f"seconds after the fault ({ph['phase']}); dashed: undone; "
                           "blue: alert firing")
    fig.suptitle(f"Fleet matrix from Prometheus: {len(nodes)} nodes x {len(ups)} API servers "
                 "(green in service, red out of service)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

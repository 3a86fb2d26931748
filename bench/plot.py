"""PNG plots for docs/performance.md from benchmark JSON.

    python bench/plot.py [--results docs/results] [--out docs]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def warm_start(data: dict, out: Path) -> None:
    rows = data["rows"]
    labels = [f"{r['size_gib']} GiB\n({r['tensors']} tensors)" for r in rows]
    series = [
        ("gms import", [r["gms"]["total_s"] for r in rows]),
        ("driver floor", [r["floor_s"] for r in rows]),
        ("CUDA IPC hand-off", [r["cuda_ipc_s"] for r in rows]),
        ("safetensors, page cache", [r["safetensors_cached_s"] for r in rows]),
        ("safetensors, cold", [r["safetensors_cold_s"] for r in rows]),
    ]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.16
    for i, (name, values) in enumerate(series):
        xs = [x + (i - 2) * width for x in range(len(rows))]
        bars = ax.bar(xs, values, width, label=name)
        for bar, v in zip(bars, values):
            label = f"{v * 1e3:.1f} ms" if v < 0.01 else f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.1f} s"
            ax.annotate(label, (bar.get_x() + width / 2, v),
                        ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("seconds to every tensor usable (log)")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_title(f"Warm start of a Llama-shaped bf16 model in a new process, {data['gpu']}")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "warm_start.png", dpi=120)


def sleep_wake(data: dict, out: Path) -> None:
    rows = data["rows"]
    series = [
        ("weights wake (gms)", [r["weights"]["wake_s"] for r in rows]),
        ("weights: driver floor", [r["weights"]["floor_wake_s"] for r in rows]),
        ("KV cache wake (gms)", [r["kv_cache"]["wake_s"] for r in rows]),
        ("KV cache: driver floor (fresh memory)", [r["kv_cache"]["floor_wake_s"] for r in rows]),
        ("CPU offload copy-back", [r["offload"]["wake_s"] for r in rows]),
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.16
    for i, (name, values) in enumerate(series):
        xs = [x + (i - 2) * width for x in range(len(rows))]
        bars = ax.bar(xs, [v * 1e3 for v in values], width, label=name)
        for bar, v in zip(bars, values):
            ax.annotate(f"{v * 1e3:.1f}", (bar.get_x() + width / 2, v * 1e3), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("wake, ms (log)")
    ax.set_xticks(range(len(rows)), [f"{r['gib']} GiB" for r in rows])
    ax.set_title(f"Wake after sleep, {data['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sleep_wake.png", dpi=120)


def rpc(data: dict, out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind in ("echo", "metadata_get", "export", "handshake"):
        runs = data["closed"][kind]
        clients = [r["clients"] for r in runs]
        left.plot(clients, [r["p50_us"] for r in runs], marker="o", label=kind)
        right.plot(clients, [r["ops_per_s"] for r in runs], marker="o", label=kind)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("closed-loop clients")
        ax.legend(fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("p50 latency, µs (log)")
    right.set_ylabel("requests per second")
    fig.suptitle(f"RPC on the {data['backend']} backend, {data['cores']} cores ({data['cpu']}); echo is the floor")
    fig.tight_layout()
    fig.savefig(out / f"rpc_{data['backend']}.png", dpi=120)


def _size_label(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def on_demand(data: dict, out: Path, name: str = "on_demand.png") -> None:
    """Per request: ms until usable, hits and restores (by model size), one panel per
    Zipf exponent; last panel: restore p50 per model size against its floor and safetensors."""
    traces = sorted(data["traces"], key=lambda t: t["exponent"])
    fig, axes = plt.subplots(1, len(traces) + 1, figsize=(4.2 * (len(traces) + 1), 4))
    sizes = sorted({e["bytes"] for e in data["catalog"]})
    colors = {size: plt.cm.plasma(0.15 + 0.7 * i / max(1, len(sizes) - 1)) for i, size in enumerate(sizes)}
    for ax, trace in zip(axes, traces):
        rows = [r for r in trace["rows"] if "error" not in r]
        hits = [r for r in rows if r["hit"]]
        ax.scatter([r["i"] for r in hits], [r["total_s"] * 1e3 for r in hits], s=5, color="tab:green",
                   label="hit")
        for size in sizes:
            restores = [r for r in rows if not r["hit"] and r["bytes"] == size]
            if restores:
                ax.scatter([r["i"] for r in restores], [r["total_s"] * 1e3 for r in restores], s=7,
                           color=colors[size], label=f"restore, {_size_label(size)}")
        failed = [r["i"] for r in trace["rows"] if "error" in r]
        if failed:
            ax.scatter(failed, [ax.get_ylim()[1]] * len(failed), marker="x", color="red", label="failed")
        summary = trace["summary"]
        ax.set_yscale("log")
        ax.set_xlabel("request")
        ax.set_ylabel("ms until usable (log)")
        ax.set_title(f"Zipf s={trace['exponent']}: {len(rows)} requests, {summary['hit_rate']:.0%} hits", fontsize=9)
    axes[0].legend(fontsize=7, loc="center right")
    ax = axes[-1]
    rows = [r for r in data.get("by_size", []) if "restore_p50_s" in r]
    unit, scale = ("GiB", 1 << 30) if max(sizes) >= 1 << 30 else ("MiB", 1 << 20)
    xs = [r["bytes"] / scale for r in rows]
    ax.plot(xs, [r["restore_p50_s"] * 1e3 for r in rows], marker="o", label="gms restore, p50")
    ax.plot(xs, [r["floor_s"] * 1e3 for r in rows], marker="s", linestyle="--",
            label="floor (" + ("pinned host -> GPU" if data["backend"] == "cuda" else "memcpy, new pages") + ")")
    for key, label, marker in (("safetensors_cached_s", "safetensors, page cache", "^"),
                               ("safetensors_cold_s", "safetensors, cold", "v")):
        st = [(r["bytes"] / scale, r[key] * 1e3) for r in data.get("by_size", []) if key in r]
        if st:
            ax.scatter(*zip(*st), marker=marker, s=40, label=label, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:.3g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(f"model {unit} (log)")
    ax.set_ylabel("ms (log)")
    ax.set_title("restores against the floor", fontsize=9)
    ax.legend(fontsize=7)
    where = data.get("gpu") or f"host backend, {data['cores']} cores ({data['cpu']})"
    fig.suptitle(f"On-demand weights: a {data['catalog_bytes'] / (1 << 30):.1f} GiB catalog, "
                 f"{_size_label(data['budget'])} GPU budget; {where}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / name, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="docs/results")
    parser.add_argument("--out", default="docs")
    args = parser.parse_args()
    results, out = Path(args.results), Path(args.out)
    for name, draw in (("warm_start_h100.json", warm_start), ("sleep_wake_h100.json", sleep_wake),
                       ("rpc_host_2core.json", rpc), ("on_demand_h100.json", on_demand),
                       ("on_demand_host_2core.json", lambda d, o: on_demand(d, o, "on_demand_host.png"))):
        path = results / name
        if path.exists():
            draw(json.loads(path.read_text()), out)
            print(f"plotted {path}")


if __name__ == "__main__":
    main()

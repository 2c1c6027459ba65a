"""The README's benchmark table, generated from a results file (never typed by hand).

``python -m benchmarks.readme_table benchmarks/results/overhead.json`` prints the markdown;
``--write README.md`` replaces the block between ``<!-- BENCHMARK TABLE -->`` and
``<!-- /BENCHMARK TABLE -->`` in that file instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from instruments.markdown import replace_block

__all__ = ["main", "table"]

#: the variants the README shows, in this order, with their label
SHOWN = {
    "numguard_default": "NumGuard defaults",
    "numguard_all": "NumGuard, every check",
    "numguard_deferred": 'NumGuard, `sync_mode="deferred"` (zero-sync)',
    "floor_default": "floor: only the reads the defaults make (`instruments/floor.py`)",
    "floor_all": "floor: only the reads every check makes",
    "spike_detection": "Lightning SpikeDetection",
    "naive_isfinite": "naive per-tensor isfinite",
    "detect_anomaly": "detect_anomaly",
}


def table(result: dict[str, Any]) -> str:
    """Step-time ratios to a plain Trainer (median of interleaved rounds), host reads per step."""
    models = list(result["models"])
    head = "| variant | " + " | ".join(models) + " | host reads / step (its own) |"
    lines = [head, "|---|" + "---:|" * len(models) + "---:|"]
    for key, label in SHOWN.items():
        cells, reads = [], set()
        for m in models:
            entry = result["models"][m]
            r = entry["variants"].get(key)
            cells.append(f"{r['ratio_median']:.3f}×" if r else "–")
            s = entry.get("host_reads", {}).get(key, {})
            # the guard's own reads (SyncCounter's attribution); another variant's are all the reads of its fit
            # beyond the plain Trainer's, which makes none
            own = s.get("per_step_guard") if key.startswith("numguard") else s.get("per_step_total")
            if own is not None:
                reads.add(f"{own:g}")
        if any(c != "–" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {', '.join(sorted(reads, key=float)) or '–'} |")
    env, cfg = result["environment"], result["config"]
    lines += [
        "",
        f"Step period ratio to a plain `Trainer` (median of up to {cfg['rounds']} interleaved rounds), "
        f"{env['device_name']}, torch {env['torch']}, {env['torch_threads']} thread(s); "
        f"`{result['command']}`.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme_table", description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="an overhead.json written by python -m benchmarks.overhead")
    p.add_argument("--write", help="a markdown file whose BENCHMARK TABLE block is replaced")
    args = p.parse_args(argv)
    text = table(json.loads(Path(args.results).read_text()))
    if not args.write:
        print(text)
        return
    replace_block(args.write, "BENCHMARK TABLE", text)


if __name__ == "__main__":
    main()

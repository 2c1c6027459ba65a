"""The guard under FSDP2: step-time overhead and snapshot memory per rank, two gloo ranks on the CPU.

``python -m benchmarks.fsdp2 [--rounds N] [--steps N] [--warmup N] [--width W] [--depth D] [--batch B]
[--variants a,b] [--out DIR]`` starts a ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``
run (Lightning relaunches this module for rank 1) of an MLP whose every block and root are ``fully_shard``-ed, and
trains it in one launch with each variant, in interleaved rounds (round r runs every variant once, the order
rotated by r, from the same initial weights on the same per-rank data):

  baseline          a plain ``pl.Trainer``
  numguard_default  ``NumGuardCallback()`` (its defaults)
  baseline_again    a second plain run: the noise floor of the day
  numguard_snapshot_every_step  the defaults with ``snapshot_every_n_steps=1`` (a snapshot's cost paid every
                    step; its snapshot holds the AdamW state too)

Each rank times its own steps with the step clock of ``benchmarks.harness`` (``perf_counter``, from the first
callback's ``on_train_batch_start`` to the last one's ``on_train_batch_end``, the first ``--warmup`` steps of
every fit discarded) and reports the median over rounds of ``median step(variant) / median step(baseline)`` of the
same round. After the guard's fit each rank reports the bytes of its snapshot against the full state's bytes
(the parameters and AdamW state of the whole, unsharded model): about 1/world when the snapshot holds only the
rank's shards. Rank 0 writes ``DIR/fsdp2.json`` and ``DIR/fsdp2.md`` with ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness import StepClock, environment, log, quiet
from lightning_numguard import NumGuardCallback

__all__ = ["main"]

VARIANTS = ("baseline", "numguard_default", "baseline_again", "numguard_snapshot_every_step")
WORLD = 2


class ShardedMLP(pl.LightningModule):
    """``width``-wide MLP of ``depth`` GELU blocks, an input and an output projection; AdamW (weight decay 0.01).

    ``configure_model`` applies ``fully_shard`` to every block and to the root over the data-parallel mesh.
    """

    def __init__(self, width: int, depth: int, n_in: int = 256, n_out: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(n_in, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.out = nn.Linear(width, n_out)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.inp, *self.blocks, self.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class _Stamp(Callback):
    """Stamps the step clock: ``start`` at batch start (put first), else at batch end (put last)."""

    def __init__(self, clock: StepClock, start: bool) -> None:
        self.clock, self.at_start = clock, start

    def on_train_batch_start(self, *args: Any) -> None:
        if self.at_start:
            self.clock.start()

    def on_train_batch_end(self, *args: Any) -> None:
        if not self.at_start:
            self.clock.end()


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the parameters and optimizer state tensors: of the whole model, and of this rank's shards."""
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]

    def whole(ts: list[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in ts)  # a DTensor's numel is the global one

    def mine(ts: list[torch.Tensor]) -> int:
        return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in ts)

    return {
        "full_param_bytes": whole(params),
        "full_state_bytes": whole(params) + whole(state),
        "local_state_bytes": mine(params) + mine(state),
    }


def snapshot_bytes(guard: NumGuardCallback) -> int | None:
    """The bytes of the guard's last snapshot on this rank (``None`` when it holds none)."""
    snapshot = getattr(getattr(guard, "_recovery", None), "snapshot", None)
    return None if snapshot is None else int(snapshot.nbytes)


def one_fit(variant: str, args: argparse.Namespace, init: dict[str, torch.Tensor]) -> dict[str, Any]:
    clock = StepClock("cpu")
    with tempfile.TemporaryDirectory(prefix="numguard-fsdp2-") as tmp:
        guard = None
        if variant.startswith("numguard"):
            every = 1 if variant == "numguard_snapshot_every_step" else 50
            guard = NumGuardCallback(dirpath=str(Path(tmp) / "ng"), snapshot_every_n_steps=every)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=ModelParallelStrategy(WORLD, 1, timeout=timedelta(seconds=300)),
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            default_root_dir=tmp,
            callbacks=[_Stamp(clock, True), *([guard] if guard else []), _Stamp(clock, False)],
        )
        model = ShardedMLP(args.width, args.depth)
        model.load_state_dict(init)
        g = torch.Generator().manual_seed(100 + int(os.environ.get("LOCAL_RANK", "0")))  # each rank its own data
        n = args.batch * (args.steps + 1)
        data = TensorDataset(torch.randn(n, 256, generator=g), torch.randint(0, 16, (n,), generator=g))
        error = None
        try:
            trainer.fit(model, DataLoader(data, batch_size=args.batch, shuffle=False))
        except Exception as err:  # report, don't hide
            error = f"{type(err).__name__}: {err}"
        steps = clock.step_ms()[args.warmup :]
        cpu = clock.cpu_step_ms()[args.warmup :]
        info: dict[str, Any] = {
            "step_ms": steps,
            "median_step_ms": statistics.median(steps) if steps else float("nan"),
            "cpu_step_ms": cpu,
            "median_cpu_step_ms": statistics.median(cpu) if cpu else float("nan"),
            "error": error,
            "steps_run": trainer.global_step,
        }
        if guard is not None:
            info["incidents"] = len(guard.events)
            info["snapshot_bytes"] = snapshot_bytes(guard)
        if trainer.optimizers:
            info.update(state_bytes(model, trainer.optimizers[0]))
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fsdp2", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=16, help="max_steps of each fit")
    p.add_argument("--warmup", type=int, default=4, help="steps discarded at the start of each fit")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="batch size per rank")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", help="write DIR/fsdp2.json and DIR/fsdp2.md (rank 0)")
    args = p.parse_args(argv)
    args.variant_list = ["baseline"] + [v for v in args.variants.split(",") if v and v != "baseline"]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    quiet()
    torch.set_num_threads(1)  # two ranks on the project's two shared cores
    torch.manual_seed(0)
    init = ShardedMLP(args.width, args.depth).state_dict()
    env = environment(argparse.Namespace(device="cpu", precision="32-true"))  # the load average at the start
    t0 = time.perf_counter()
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variant_list}
    one_fit("baseline", args, init)  # untimed: one-time costs out of round 1 (and the process group up)
    for r in range(args.rounds):
        k = r % len(args.variant_list)
        for v in args.variant_list[k:] + args.variant_list[:k]:
            info = one_fit(v, args, init)
            rounds[v].append(info)
            if torch.distributed.get_rank() == 0:
                log(f"  round {r + 1}/{args.rounds} {v:<29} {info['median_step_ms']:8.2f} ms/step (rank 0)")
    mine = {"rank": torch.distributed.get_rank(), "variants": summarise(rounds, args.variant_list)}
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    if torch.distributed.get_rank() != 0:
        return None
    result = {
        "command": " ".join(["python", "-m", "benchmarks.fsdp2", *(sys.argv[1:] if argv is None else argv)]),
        "environment": env,
        "config": {k: getattr(args, k) for k in ("rounds", "steps", "warmup", "width", "depth", "batch")}
        | {"variants": args.variant_list, "world": WORLD},
        "ranks": every,
        "wall_s": time.perf_counter() - t0,
    }
    with contextlib.suppress(OSError):
        result["environment"]["loadavg_end"] = os.getloadavg()
    report = render(result)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fsdp2.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "fsdp2.md").write_text(report + "\n")
        log(f"wrote {out / 'fsdp2.json'} and {out / 'fsdp2.md'}")
    return result


def summarise(rounds: dict[str, list[dict[str, Any]]], variants: list[str]) -> dict[str, Any]:
    """Per variant: the per-round ratios to the same round's baseline, their median and range, the bytes."""
    out: dict[str, Any] = {}
    for v in variants:
        ratios = [x["median_step_ms"] / b["median_step_ms"] for x, b in zip(rounds[v], rounds["baseline"])]
        cpu = [x["median_cpu_step_ms"] / b["median_cpu_step_ms"] for x, b in zip(rounds[v], rounds["baseline"])]
        last = rounds[v][-1]
        out[v] = {
            "rounds": rounds[v],
            "median_step_ms": statistics.median(x["median_step_ms"] for x in rounds[v]),
            "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "cpu_ratio_per_round": cpu,
            "cpu_ratio_median": statistics.median(cpu),
            "errors": [x["error"] for x in rounds[v] if x["error"]],
            "incidents": sum(x.get("incidents", 0) for x in rounds[v]),
            **{k: v for k, v in last.items() if k.endswith("_bytes")},
        }
    return out


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def render(result: dict[str, Any]) -> str:
    cfg, env = result["config"], result["environment"]
    ranks = result["ranks"]
    lines = [
        "## FSDP2 (ModelParallelStrategy, 2 gloo ranks on the CPU)",
        "",
        f"`{result['command']}`: an MLP of {cfg['depth']} residual GELU blocks {cfg['width']} wide "
        f"(`fully_shard` on every layer and the root), AdamW, batch {cfg['batch']} per rank, "
        f"{cfg['steps']} steps per fit ({cfg['warmup']} discarded), {cfg['rounds']} interleaved rounds; "
        f"{env.get('device_name', '?')}, torch {env.get('torch')}, Lightning {env.get('pytorch_lightning')}, "
        f"1 torch thread per rank; step clock: perf_counter wall time, each rank its own.",
        "",
        "| variant | "
        + " | ".join(f"rank {r['rank']}: median step" for r in ranks)
        + " | "
        + " | ".join(f"rank {r['rank']}: ratio to baseline (min-max)" for r in ranks)
        + " | "
        + " | ".join(f"rank {r['rank']}: thread-CPU-time ratio" for r in ranks)
        + " | errors |",
        "|---|" + "---:|" * (3 * len(ranks)) + "---|",
    ]
    for v in cfg["variants"]:
        cells = [f"{r['variants'][v]['median_step_ms']:.1f} ms" for r in ranks]
        cells += [
            f"{r['variants'][v]['ratio_median']:.3f}x ({r['variants'][v]['ratio_min']:.3f}-"
            f"{r['variants'][v]['ratio_max']:.3f})"
            for r in ranks
        ]
        cells += [f"{r['variants'][v]['cpu_ratio_median']:.3f}x" for r in ranks]
        errors = sorted({e for r in ranks for e in r["variants"][v]["errors"]})
        lines.append(f"| `{v}` | " + " | ".join(cells) + f" | {'; '.join(errors)[:200] or '-'} |")
    lines += [
        "",
        "Ratios: the median over rounds of `median step(variant) / median step(baseline)` of the same round. The step",
        "clock is the verdict; the training thread's CPU time over the same window is information only (it leaves",
        "out the time other processes took the cores, and the time a rank waits for the other in a collective).",
    ]
    lines += [
        "",
        "Snapshot memory per rank: the guard's last snapshot (`Snapshot.nbytes`: this rank's shards of the parameters",
        "and AdamW state, plus buffers and RNG) against the whole model's parameters, and its parameters and AdamW",
        "state (after the fit), and against the shards of those this rank holds. Under the defaults the one snapshot",
        "of a short fit is the one taken at train start, before AdamW has state: compare it with the parameters;",
        "`numguard_snapshot_every_step` holds the AdamW state too.",
        "",
        "| variant | rank | full parameters | full parameters + AdamW | this rank's shards of both | snapshot "
        "| snapshot / full parameters | snapshot / full parameters + AdamW |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in cfg["variants"]:
        for r in ranks:
            x = r["variants"][v]
            if "snapshot_bytes" not in x:
                continue
            snap = x.get("snapshot_bytes")
            shares = [
                "-" if not snap or not x.get(k) else f"{snap / x[k]:.3f}"
                for k in ("full_param_bytes", "full_state_bytes")
            ]
            lines.append(
                f"| `{v}` | {r['rank']} | {_mb(x.get('full_param_bytes'))} | {_mb(x.get('full_state_bytes'))} "
                f"| {_mb(x.get('local_state_bytes'))} | {_mb(snap)} | {shares[0]} | {shares[1]} |"
            )
    lines += ["", f"Wall time {result['wall_s']:.0f} s. Raw per-step times: `fsdp2.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # see tests/doors/trainer/ddp_script.py

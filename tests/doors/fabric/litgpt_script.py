"""Run by test_litgpt.py in a subprocess: LitGPT's real ``litgpt.pretrain.setup`` on the tiny set-up of
``litgpt_parts.py``, unchanged; the guard, when there is one, comes from ``NUMGUARD``/``NUMGUARD_CONFIG`` alone.

Usage: python litgpt_script.py OUT_DIR RUN[,RUN...]  where RUN is NAME:ENV:FAULTS, e.g. ``clean:0:`` (no guard),
``guarded:1:`` (NUMGUARD=1), ``config:yaml:`` (NUMGUARD_CONFIG=OUT_DIR/numguard.yaml), ``faults:1:nan4+tok5`` (a NaN
weight left by the optimizer after its 4th step, a token id past the vocabulary in batch 5). Each run writes
OUT_DIR/NAME.json (how it ended, the dynamo graph count and the reasons of its recompiles, the guard's events read
from every events.jsonl under the run's folder, whether the final weights are finite) and OUT_DIR/NAME.pt (the final
weights, from LitGPT's own final checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path

import torch
import torch._dynamo
import torch._logging

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def run(out: Path, name: str, env: str, faults: list[str]) -> None:
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.pretrain import setup

    from tests.doors.fabric import litgpt_parts as parts

    os.environ.pop("NUMGUARD", None)
    os.environ.pop("NUMGUARD_CONFIG", None)
    if env == "yaml":
        os.environ["NUMGUARD_CONFIG"] = str(out / "numguard.yaml")
    elif env != "0":
        os.environ["NUMGUARD"] = env
    nan_after = next((int(f[3:]) for f in faults if f.startswith("nan")), 0)
    bad_batch = next((int(f[3:]) for f in faults if f.startswith("tok")), None)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recompiles: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: recompiles.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(handler)
    run_dir = out / name
    sys.argv[1:] = ["tiny-gpt"]  # LitGPT's final checkpoint re-parses the command line as its own CLI
    result: dict = {"name": name}
    iters = 12
    try:
        setup(
            "pythia-14m",
            model_config=parts.tiny_config(),
            out_dir=run_dir,
            precision="32-true",
            data=parts.TokenData(bad_batch=bad_batch),
            train=TrainArgs(
                save_interval=None,
                log_interval=1,
                global_batch_size=parts.MICRO,
                micro_batch_size=parts.MICRO,
                max_tokens=iters * parts.MICRO * parts.BLOCK,
                max_norm=1.0,
                min_lr=1e-4,
                lr_warmup_steps=2,
                tie_embeddings=False,
            ),
            eval=EvalArgs(interval=1000, max_iters=1, initial_validation=False, final_validation=False),
            optimizer={
                "class_path": "tests.doors.fabric.litgpt_parts.NaNAfterStep",
                "init_args": {"lr": 1e-3, "nan_after": nan_after},
            },
            devices=1,
            logger_name="tensorboard",
            seed=7,
        )
        result["raised"] = None
    except BaseException as err:
        result["raised"] = f"{type(err).__name__}: {err}"[:600]
        result["trace"] = traceback.format_exc()[-3000:]
    logging.getLogger("torch._dynamo.guards.__recompiles").removeHandler(handler)
    result["recompiles"] = recompiles
    result["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    result["graph_breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
    ckpt = run_dir / "final" / "lit_model.pth"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)["model"]
        torch.save(state, out / f"{name}.pt")
        result["finite"] = all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())
    events = sorted(run_dir.rglob("events.jsonl"))
    result["events_files"] = [str(p) for p in events]
    result["events"] = [json.loads(x) for p in events for x in p.read_text().splitlines()]
    (out / f"{name}.json").write_text(json.dumps(result))


def main() -> None:
    torch._logging.set_logs(recompiles=True)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for spec in sys.argv[2].split(","):
        name, env, faults = spec.split(":")
        run(out, name, env, [f for f in faults.split("+") if f])


if __name__ == "__main__":
    main()

"""Run by test_litgpt.py in a subprocess: LitGPT's real ``litgpt.pretrain.setup`` on the tiny set-up of
``litgpt_parts.py``, unchanged; the guard, when there is one, comes from ``NUMGUARD``/``NUMGUARD_CONFIG`` alone.

Usage: python litgpt_script.py OUT_DIR RUN[,RUN...]  where RUN is NAME:ENV:FAULTS, e.g. ``clean:0:`` (no guard),
``guarded:1:`` (NUMGUARD=1), ``faults:1:nan4,tok5`` (NaN weight after the optimizer's 4th step, a token id past the
vocabulary in batch 5). Each run writes OUT_DIR/NAME.json: how it ended, the final weights' digest, the dynamo
graph count, the guard's events (read from events.jsonl), and the final weights (OUT_DIR/NAME.pt).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def run(out: Path, name: str, env: str, faults: list[str]) -> None:
    import torch._dynamo
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.pretrain import setup

    from tests.doors.fabric import litgpt_parts as parts

    os.environ.pop("NUMGUARD", None)
    if env != "0":
        os.environ["NUMGUARD"] = env
    nan_after = next((int(f[3:]) for f in faults if f.startswith("nan")), 0)
    bad_batch = next((int(f[3:]) for f in faults if f.startswith("tok")), None)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
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
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for spec in sys.argv[2].split(","):
        name, env, faults = spec.split(":")
        run(out, name, env, [f for f in faults.split("+") if f])


if __name__ == "__main__":
    main()

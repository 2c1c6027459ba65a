"""Every recipe in ``examples/`` runs as written, in its fast mode, in a fresh interpreter (issue 27).

Each script is run the way its docstring says (``python examples/<script>.py --fast``; the LightningCLI one with its
YAML file and ``--trainer.max_steps``), from a temporary folder, and what it printed is checked: the guard caught
the fault the recipe injects, named it, and acted.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(args: list[str], tmp_path: Path, timeout: int = 240, temp: Path | None = None) -> str:
    """Run an example in ``tmp_path``; ``temp``: the temporary folder its ``tempfile`` calls get (``TMPDIR``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env.pop("NUMGUARD_EXAMPLE_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MASTER_PORT"] = str(_free_port())
    env["OMP_NUM_THREADS"] = "1"
    if temp is not None:
        temp.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(temp)
    proc = subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


RUNS = {
    "fsdp2_nan_in_a_shard.py": ["--fast"],
    "deferred_fused_optimizer.py": ["--fast"],
    "hf_finetune.py": ["--fast"],
    "lightning_cli.py": ["fit", "--config", str(EXAMPLES / "lightning_cli.yaml"), "--trainer.max_steps", "6"],
    "fabric_loop.py": ["--fast"],
    "plain_loop.py": ["--fast"],
}


def test_every_example_is_run_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)
    for name in RUNS:  # each says how to run it, as the test runs it
        assert f"python examples/{name}" in (EXAMPLES / name).read_text(encoding="utf-8"), name
    strategies = (ROOT / "docs" / "strategies.md").read_text(encoding="utf-8")
    assert "python examples/fsdp2_nan_in_a_shard.py --fast" in strategies  # the docs point at the recipe


def _written_in_a_temporary_folder(out: str, cwd: Path, temp: Path) -> Path:
    """The folder the example said it wrote to: a new one under ``temp``, and nothing in the working directory."""
    assert sorted(cwd.iterdir()) == [], sorted(cwd.iterdir())
    (folder,) = re.findall(r"^files in: (.+)$", out, re.M)
    assert Path(folder).parent == temp and Path(folder).is_dir(), folder
    return Path(folder)


def test_fsdp2_a_nan_in_one_ranks_shard_is_named_and_rolled_back(tmp_path: Path) -> None:
    """Without ``--dir``: both processes write into one temporary folder (the rollback's sharded checkpoint), never
    the working directory (before: an untracked ``numguard-examples/`` in the repository)."""
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    out = _run([str(EXAMPLES / "fsdp2_nan_in_a_shard.py"), *RUNS["fsdp2_nan_in_a_shard.py"]], cwd, temp=temp)
    assert "step 3 rank 1: nonfinite_param in ['fc1.weight'] -> rollback" in out, out
    assert re.search(r"counters: \{'incidents': 1, 'skipped_steps': 1, 'rollbacks': 1.*finished at step 8", out), out
    folder = _written_in_a_temporary_folder(out, cwd, temp)
    # the second process made no folder of its own (torch may keep its caches there too)
    assert [p.name for p in temp.iterdir() if p.name.startswith("numguard-")] == [folder.name]
    assert (folder / "numguard" / "events.jsonl").exists()


def test_deferred_mode_with_a_fused_optimizer_skips_the_nan_step_one_step_late(tmp_path: Path) -> None:
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    out = _run([str(EXAMPLES / "deferred_fused_optimizer.py"), "--fast"], cwd, temp=temp)
    assert "step 5: nonfinite_loss in ['loss'] -> skip, read at step 6" in out, out
    assert "'skipped_steps': 1" in out and "weights finite: True" in out, out
    assert (_written_in_a_temporary_folder(out, cwd, temp) / "numguard" / "events.jsonl").exists()


def test_hugging_face_bf16_with_padding_masks_reports_only_the_injected_nan(tmp_path: Path) -> None:
    out = _run([str(EXAMPLES / "hf_finetune.py"), "--fast", "--dir", "run"], tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    # the masked attention's most negative bf16 values are not reported: the only events are step 5's
    assert lines[0] == "step 5: nonfinite_output in ['model.bert.embeddings.word_embeddings'] -> rollback", out
    assert all(line.startswith("step 5: ") for line in lines), out
    assert "'incidents': 1, 'skipped_steps': 1, 'rollbacks': 1" in out, out


def test_lightning_cli_with_the_yaml_file(tmp_path: Path) -> None:
    """The YAML names no folder: logs and events go to a temporary one, never the working directory."""
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    _run([str(EXAMPLES / "lightning_cli.py"), *RUNS["lightning_cli.py"]], cwd, temp=temp)
    assert sorted(cwd.iterdir()) == []
    (events,) = temp.rglob("events.jsonl")
    text = events.read_text(encoding="utf-8")
    assert '"kind": "nonfinite_loss"' in text and '"action": "rollback"' in text and '"step": 3' in text, text
    assert (events.parent / "trace.csv").exists()


def test_a_fabric_loop_guarded_by_one_line_survives_both_faults(tmp_path: Path) -> None:
    out = _run([str(EXAMPLES / "fabric_loop.py"), "--fast", "--dir", "run"], tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert lines == [
        "step 4 micro-batch 8: nonfinite_grad in ['block.1.weight'] -> rollback",
        "step 7 micro-batch 14: op_domain in ['embedding'] (wte) -> rollback",
    ], out
    assert "'rollbacks': 2" in out and "weights finite: True" in out, out


def test_the_seeds_plain_loop_guarded_by_two_lines_goes_on(tmp_path: Path) -> None:
    out = _run([str(EXAMPLES / "plain_loop.py"), "--fast", "--dir", "run"], tmp_path)
    assert "step 0: optimizer_coverage in ['netG.sub_mean.weight', 'netG.sub_mean.bias'] -> none" in out, out
    assert "step 5: nonfinite_input in [\"batch['x']\"] -> rollback" in out, out
    assert "step 5: op_domain in ['binary_cross_entropy'] -> rollback" in out, out
    assert "'rollbacks': 1" in out and "weights finite: True" in out, out
    assert (tmp_path / "run" / "events.jsonl").is_file()


def test_the_zero_code_config_file_builds_the_guards() -> None:
    from lightning_numguard.doors.optin import requested_init_args
    from lightning_numguard.fabric import NumGuard

    args = requested_init_args({"NUMGUARD_CONFIG": str(EXAMPLES / "numguard.yaml")})
    assert args is not None and args["action"] == "rollback"
    assert NumGuard(**args).recovery.quarantine is True

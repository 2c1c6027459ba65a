"""``NumGuardCallback`` configured through a real ``LightningCLI`` (jsonargparse) from YAML."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import docstring_parser
import pytest
import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.demos.boring_classes import BoringDataModule, BoringModel
from torch.utils.data import DataLoader

import lightning_numguard
from lightning_numguard.callbacks import NumGuardCallback
from lightning_numguard.config.groups import GROUPS, field_docs
from lightning_numguard.errors import NumGuardWarning
from tests.helpers import FaultData, FaultModel, loader

CLASS_PATH = "lightning_numguard.NumGuardCallback"
INIT_ARGS = (
    "{action: skip, max_abs_input: 1.0e6, check: [inputs, loss, grads], snapshot_every_n_steps: 5, lr_backoff: 0.5}"
)


class FaultDataModule(pl.LightningDataModule):
    """The shared fault data as a datamodule (the CLI needs a class importable by name)."""

    def train_dataloader(self) -> DataLoader:
        return loader(FaultData())


def _write_config(tmp_path: Path, init_args: str, class_path: str = CLASS_PATH, extra: str = "") -> Path:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        f"""\
trainer:
  default_root_dir: {tmp_path}
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: {class_path}
      init_args: {init_args}
{extra}"""
    )
    return cfg


def _cli(args: list[str], model: type = BoringModel, data: type = BoringDataModule, **kw: Any) -> LightningCLI:
    kw.setdefault("run", False)
    return LightningCLI(model, data, args=args, save_config_callback=None, seed_everything_default=False, **kw)


def _guards(trainer: pl.Trainer) -> list[NumGuardCallback]:
    return [c for c in trainer.callbacks if isinstance(c, NumGuardCallback)]


def _norm(text: str) -> str:
    """Whitespace folded, and argparse's line breaks after a hyphen ("non-" / "finite") joined."""
    return re.sub(r"(?<=\w)- (?=\w)", "-", " ".join(text.split()))


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when ``args`` is given while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["numguard-cli-test"])


# ----------------------------------------------------------------------------- instantiation


def test_top_level_export_is_the_callback() -> None:
    """DESIGN public contract: ``from lightning_numguard import NumGuardCallback``."""
    assert "NumGuardCallback" in lightning_numguard.__all__
    assert lightning_numguard.NumGuardCallback is NumGuardCallback
    assert issubclass(NumGuardCallback, pl.Callback)


@pytest.mark.parametrize("class_path", [CLASS_PATH, "lightning_numguard.callbacks.NumGuardCallback"])
def test_yaml_builds_the_callback_with_the_given_values(tmp_path: Path, class_path: str) -> None:
    cfg = _write_config(tmp_path, INIT_ARGS, class_path=class_path)
    cli = _cli(["--config", str(cfg)])
    (cb,) = _guards(cli.trainer)
    assert cb.action == "skip"
    assert cb.max_abs_input == 1.0e6
    assert isinstance(cb.max_abs_input, float)
    assert cb.check == ["inputs", "loss", "grads"]
    assert cb.snapshot_every_n_steps == 5
    assert cb.lr_backoff == 0.5
    # untouched arguments keep their defaults
    assert cb.max_rollbacks == NumGuardCallback().max_rollbacks
    assert cb.dirpath is None


def test_yaml_null_and_nested_values(tmp_path: Path) -> None:
    cfg = _write_config(
        tmp_path,
        "{action: warn, max_abs_input: null, dirpath: "
        + str(tmp_path / "ng")
        + ", watch: {ignore: ['head*']}, check_optimizer_coverage: 'off', recovery: {replay: false}}",
    )
    (cb,) = _guards(_cli(["--config", str(cfg)]).trainer)
    assert cb.action == "warn"
    assert cb.max_abs_input is None
    assert cb.dirpath == str(tmp_path / "ng")
    assert cb.watch.ignore == ["head*"]
    assert cb.check_optimizer_coverage == "off"
    assert cb.recovery.replay is False


def test_command_line_append_and_override(tmp_path: Path) -> None:
    cli = _cli(
        [
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
            f"--trainer.callbacks+={CLASS_PATH}",
            "--trainer.callbacks.action=halt",
            "--trainer.callbacks.max_rollbacks=3",
        ]
    )
    (cb,) = _guards(cli.trainer)
    assert (cb.action, cb.max_rollbacks) == ("halt", 3)


# ----------------------------------------------------------------------------- --help


def test_help_lists_every_argument_with_its_docstring(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exc:
        _cli(["--trainer.callbacks.help", CLASS_PATH])
    assert exc.value.code == 0
    out = _norm(capsys.readouterr().out)
    params = {p.arg_name: p.description for p in docstring_parser.parse(NumGuardCallback.__doc__).params}
    names = [n for n in inspect.signature(NumGuardCallback).parameters if n not in ("args", "kwargs")]
    assert {"action", "dirpath", "max_abs_input", "snapshot_every_n_steps", "lr_backoff"} <= set(names)
    for name in names:
        assert params.get(name), f"`{name}` has no entry in the class docstring's Args:"
        assert f"--trainer.callbacks.{name}" in out, name
        if name in GROUPS:  # a group: its entry heads its section, each of its fields under its key
            group = GROUPS[name]
            assert _norm(params[name]).rstrip(".") + ":" in out, (name, params[name])
            for part, doc in field_docs(group).items():
                assert f"--trainer.callbacks.{name}.{part}" in out, (name, part)
                assert _norm(doc).replace("``", "`") in out, (name, part, doc)
        else:
            assert _norm(params[name]) in out, (name, params[name])
    # choices and defaults come from the type hints
    assert "{warn,skip,rollback,halt}" in out
    assert "default: rollback" in out


def test_help_for_unknown_class_fails(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _cli(["--trainer.callbacks.help", "lightning_numguard.NoSuchCallback"])
    assert exc.value.code != 0
    assert "NoSuchCallback" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("init_args", "argument", "value"),
    [
        ("{action: explode}", "action", "explode"),
        ("{check_optimizer_coverage: loud}", "check_optimizer_coverage", "loud"),
        ("{snapshot_every_n_steps: often}", "snapshot_every_n_steps", "often"),
        ("{max_abs_input: huge}", "max_abs_input", "huge"),
    ],
)
def test_bad_type_fails_at_parse_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], init_args: str, argument: str, value: str
) -> None:
    cfg = _write_config(tmp_path, init_args)
    with pytest.raises(SystemExit) as exc:
        _cli(["--config", str(cfg)])
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    assert f'Parser key "{argument}"' in err
    assert value in err


@pytest.mark.parametrize(
    ("init_args", "match"),
    [
        (
            "{sync_mode: deferred, recovery: {retry_transient: true}}",
            r"`recovery.retry_transient=True` re-runs a batch .* one or the other",
        ),
        # a limit that spans two arguments: no one argument's type can carry it (issue 27)
        ("{spikes: {warmup: 500}}", r"`spikes.warmup` must be None or an integer in \[1, spikes.window=128\], got 500"),
    ],
)
def test_bad_value_of_right_type_fails_at_instantiation(tmp_path: Path, init_args: str, match: str) -> None:
    """Values each of the right type whose combination is invalid pass jsonargparse and are refused by ``__init__``
    (a value out of its own range is refused while parsing: see the test below).

    jsonargparse tries each member of ``trainer.callbacks``' Union type and raises a plain
    ``ValueError`` that carries the ``NumGuardConfigError`` message naming argument and value.
    """
    cfg = _write_config(tmp_path, init_args)
    with pytest.raises(ValueError, match=match):
        _cli(["--config", str(cfg)])


# ----------------------------------------------------------------------------- fit subcommand


def test_fit_subcommand_runs_with_the_configured_callback(tmp_path: Path) -> None:
    extra = "  max_steps: 4\nmodel:\n  site: loss\n  step: 2\n"
    cfg = _write_config(tmp_path, "{action: skip, recovery: {replay: false}}", extra=extra)
    with pytest.warns(NumGuardWarning, match=r"the loss is non-finite at step 2 on rank 0"):
        cli = _cli(["fit", "--config", str(cfg)], model=FaultModel, data=FaultDataModule, run=True)
    assert cli.trainer.state.finished
    assert cli.trainer.global_step == 4
    (cb,) = _guards(cli.trainer)
    assert cb.action == "skip"
    assert cb.counters["skipped_steps"] == 1
    assert cb.resolved_dirpath == tmp_path / "numguard"
    lines = (tmp_path / "numguard" / "events.jsonl").read_text().splitlines()
    assert [(e["kind"], e["step"], e["action"]) for e in map(json.loads, lines)] == [("nonfinite_loss", 2, "skip")]


def test_fit_subcommand_boring_model_clean_run(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path, INIT_ARGS, extra="  max_steps: 4\n")
    cli = _cli(["fit", "--config", str(cfg)], run=True)
    assert cli.trainer.global_step == 4
    (cb,) = _guards(cli.trainer)
    assert cb.counters == {"incidents": 0, "skipped_steps": 0, "rollbacks": 0, "amp_overflow_steps": 0, "spikes": 0}
    assert cb.events == []


# ----------------------------------------------------------------------------- constraints in the types (issue 20)


@pytest.mark.parametrize(
    ("init_args", "argument", "allowed", "given"),
    [
        ("{snapshot_every_n_steps: -3}", "snapshot_every_n_steps", "PositiveInt", "-3"),
        ("{max_rollbacks: -1}", "max_rollbacks", "NonNegativeInt", "-1"),
        ("{skip_batches_after_rollback: -2}", "skip_batches_after_rollback", "NonNegativeInt", "-2"),
        ("{lr_backoff: 2.0}", "lr_backoff", "float in (0, 1]", "2.0"),
        ("{watch: {depth: 0}}", "watch.depth", "PositiveInt", "0"),
        ("{max_abs_input: -1.0}", "max_abs_input", "PositiveFloat", "-1.0"),
        ("{spikes: {overflow_headroom: 0.5}}", "spikes.overflow_headroom", "float >= 1", "0.5"),
        ("{spikes: {warmup: 0}}", "spikes.warmup", "PositiveInt", "0"),
        ("{check: [inputs, bogus]}", "check", "'optimizer_state'", "bogus"),
        ("{action: explode}", "action", "'warn', 'skip', 'rollback', 'halt'", "explode"),
    ],
)
def test_a_bad_value_is_refused_at_parse_time_naming_argument_allowed_and_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], init_args: str, argument: str, allowed: str, given: str
) -> None:
    """No traceback: jsonargparse refuses the value while parsing, from the argument's type.

    What jsonargparse wraps around the callback's part is not the callback's to shorten: the parser's usage
    (LightningCLI's, tens of lines) and the list of ``trainer.callbacks``' Union members. The callback's part,
    from ``Parser key "<argument>"`` on, is a few lines that say the argument, what is allowed and what was given.
    """
    cfg = _write_config(tmp_path, init_args)
    with pytest.raises(SystemExit) as exc:
        _cli(["--config", str(cfg)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    error = err[err.index("error:") :]
    part = error[error.index(f'Parser key "{argument}"') : error.index("- Not a valid subclass of Callback")]
    assert len(part.splitlines()) < 10, part
    assert allowed in part, part
    assert given in part, part


def test_a_value_refused_by_its_type_is_refused_by_init_too() -> None:
    """The types carry the constraints to the CLI; Python callers get the same checks from ``__init__``."""
    with pytest.raises(ValueError, match=r"`snapshot_every_n_steps` must be an integer >= 1, got -3"):
        NumGuardCallback(snapshot_every_n_steps=-3)
    with pytest.raises(ValueError, match=r"`lr_backoff` must be a number in \(0, 1\], got 2\.0"):
        NumGuardCallback(lr_backoff=2.0)


def test_values_parsed_through_the_constrained_types_are_plain_numbers(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path, "{snapshot_every_n_steps: 7, max_rollbacks: 0, lr_backoff: 0.5, watch: {depth: 2}}")
    (cb,) = _guards(_cli(["--config", str(cfg)]).trainer)
    values = (cb.snapshot_every_n_steps, cb.max_rollbacks, cb.lr_backoff, cb.watch.depth)
    assert values == (7, 0, 0.5, 2)
    assert [type(v) for v in values] == [int, int, float, int]  # plain: picklable, YAML- and state-friendly


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """No reStructuredText markup (double backticks) in ``--help``; a deprecated name says where it moved."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        _cli(["--trainer.callbacks.help", CLASS_PATH])
    out = capsys.readouterr().out
    assert "--trainer.callbacks.action" in out  # control
    assert "``" not in out
    assert "--trainer.callbacks.warn " not in out
    moved = [n for n, a in NumGuardCallback.__arguments__.items() if a.moved_to]
    assert len(moved) == _norm(out).count("deprecated, accepted and mapped") == 15, moved


def test_the_package_imports_and_validates_without_jsonargparse() -> None:
    """jsonargparse is the optional ``cli`` extra: without it the types are plain ``int``/``float``."""
    code = (
        "import sys; sys.modules['jsonargparse'] = None\n"
        "from lightning_numguard import NumGuardCallback, NumGuardConfigError\n"
        "from lightning_numguard.config import argtypes as _types\n"
        "assert (_types.PositiveInt, _types.NonNegativeInt, _types.PositiveFloat, _types.Backoff) == (int, int, float, float)\n"
        "assert NumGuardCallback(snapshot_every_n_steps=3).snapshot_every_n_steps == 3\n"
        "try:\n"
        "    NumGuardCallback(snapshot_every_n_steps=-3)\n"
        "except NumGuardConfigError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "`snapshot_every_n_steps` must be an integer >= 1, got -3"


def test_plain_args_changes_only_the_args_section() -> None:
    from lightning_numguard.config.argtypes import plain_args

    doc = 'Do ``x``.\n\n    Args:\n        a: ``"on"`` or ``None``.\n            More ``b``.\n\n    Raises:\n        E: ``c``.\n'
    assert (
        plain_args(doc)
        == 'Do ``x``.\n\n    Args:\n        a: `"on"` or `None`.\n            More `b`.\n\n    Raises:\n        E: ``c``.\n'
    )
    assert plain_args("no sections ``x``") == "no sections ``x``"
    assert plain_args(None) is None

"""Arguments with a history: ``emit_warnings`` and the removed ``warn=`` alias."""

from __future__ import annotations

import inspect
import warnings

import pytest

from lightning_numguard import NumGuardCallback, NumGuardConfigError
from tests.helpers import FaultData, FaultModel, loader, trainer


def test_the_removed_warn_alias_is_refused():
    """``warn=`` (a deprecated alias of ``emit_warnings`` whose name clashed with ``action="warn"``) is gone."""
    assert "warn" not in inspect.signature(NumGuardCallback).parameters
    with pytest.raises(TypeError, match="'warn'"):
        NumGuardCallback(warn=False)  # type: ignore[call-arg]


def test_emit_warnings_false_keeps_events_but_warns_nothing(tmp_path):
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), emit_warnings=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [guard], max_steps=5).fit(FaultModel(), loader(FaultData(bad_batch=3, site="input")))
    assert guard.events and guard.events[0]["kind"] == "nonfinite_input"
    assert not [w for w in caught if "NumGuard:" in str(w.message)]


def test_a_bad_emit_warnings_value_names_the_argument():
    with pytest.raises(NumGuardConfigError, match=r"`emit_warnings` must be True or False, got 'yes'"):
        NumGuardCallback(emit_warnings="yes")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- arguments declared once, read-only


MOVED = {
    "watch_depth": ("watch", "depth", 2),
    "snapshot_device": ("snapshot", "device", "device"),
    "spike_sigma": ("spikes", "sigma", 6.0),
    "spike_window": ("spikes", "window", 64),
    "retry_transient": ("recovery", "retry_transient", True),
    "halt_raises": ("recovery", "halt_raises", False),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_flat_name_is_accepted_mapped_into_its_group_and_deprecated(old):
    group, part, value = MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"`{group}` group as `{group}\.{part}`") as caught:
        cb = NumGuardCallback(**{old: value})
    assert caught[0].filename == __file__  # attributed to the caller's line, not to the package
    assert getattr(getattr(cb, group), part) == value
    assert getattr(getattr(cb._flow.settings, group), part) == value  # what the engine acts on
    with pytest.warns(DeprecationWarning, match=old):  # reading the old name gives the group's value
        assert getattr(cb, old) == value


def test_a_group_given_as_a_mapping_or_an_object_is_the_same_and_a_bad_field_is_named():
    from lightning_numguard.config.groups import SpikeConfig

    assert NumGuardCallback(spikes={"sigma": 7.0}).spikes == NumGuardCallback(spikes=SpikeConfig(sigma=7.0)).spikes
    with pytest.raises(NumGuardConfigError, match=r"`spikes` got \{'sigmas': 7.0\}: .*unexpected keyword argument"):
        NumGuardCallback(spikes={"sigmas": 7.0})
    with pytest.raises(NumGuardConfigError, match=r"`spikes.window` must be an integer >= 0, got -1"):
        NumGuardCallback(spikes={"window": -1})


@pytest.mark.parametrize(("name", "value"), [("action", "explode"), ("spikes", {"sigma": 3.0}), ("dirpath", "x")])
def test_arguments_are_read_only_once_built(name, value):
    """``cb.action = "explode"`` before ``fit`` used to be accepted and acted on; it now raises, naming the argument."""
    cb = NumGuardCallback()
    with pytest.raises(AttributeError, match=rf"NumGuardCallback\.{name} is read-only once built"):
        setattr(cb, name, value)
    assert cb._flow.settings.action == "rollback"


def test_one_declaration_gives_the_signature_the_docstring_and_the_engines_configuration():
    from lightning_numguard.config.arguments import GuardConfig

    declared = list(GuardConfig.__arguments__)
    assert list(inspect.signature(NumGuardCallback).parameters) == declared
    doc = NumGuardCallback.__doc__ or ""
    assert all(f"        {name}: " in doc for name in declared)  # every argument has its Args: entry
    settings = NumGuardCallback(action="skip", lr_backoff=0.5)._flow.settings
    assert type(settings) is GuardConfig and (settings.action, settings.lr_backoff) == ("skip", 0.5)

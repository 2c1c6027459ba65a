"""The checks are declared once (``core/registry``): kinds, their causal order, advisory kinds, hints and the README's
table of kinds all come from that declaration."""

from __future__ import annotations

from lightning_numguard.detect import registry
from lightning_numguard.diagnose.findings import Finding, causal_position
from lightning_numguard.reporting import events
from lightning_numguard.reporting.hints import KIND_HINTS, kind_hint


def test_kinds_advisory_kinds_and_hints_are_the_registrys() -> None:
    assert tuple(c.kind for c in registry.CHECKS) == events.KINDS
    assert events.ADVISORY_KINDS == ("optimizer_coverage", "overflow_risk")
    assert set(events.ADVISORY_KINDS) == {c.kind for c in registry.CHECKS if c.advisory}
    assert dict(KIND_HINTS) == {c.kind: c.hint for c in registry.CHECKS}
    assert len(set(events.KINDS)) == len(events.KINDS), "a kind declared twice"


def test_the_registry_order_is_the_order_findings_of_a_step_are_sorted_in() -> None:
    findings = [Finding(kind, ["x"], {}) for kind in reversed(events.KINDS)]
    assert [f.kind for f in sorted(findings, key=causal_position)] == list(events.KINDS)


def test_a_check_added_to_a_registry_gets_its_kind_position_hint_and_row() -> None:
    toy = registry.Check("toy threshold", "toy_kind", "a toy value above its threshold", "lower it", "lower the toy")
    checks = (*registry.CHECKS[:2], toy, *registry.CHECKS[2:])
    assert registry.kinds(checks)[2] == "toy_kind"
    assert registry.kind_hints(checks)["toy_kind"] == "lower the toy"
    assert "toy_kind" not in registry.advisory_kinds(checks)
    advisory = registry.Check("toy threshold", "toy_kind", "a toy value", "lower it", "lower the toy", advisory=True)
    assert "toy_kind" in registry.advisory_kinds((advisory,))
    rows = registry.kinds_table(checks).splitlines()
    assert rows[2 + 2] == "| `toy_kind` | a toy value above its threshold | lower it |"
    assert kind_hint("toy_kind") != "lower the toy"  # the package's own registry does not hold it


def test_every_declared_kind_has_its_own_sentence() -> None:
    from lightning_numguard.reporting.messages import SENTENCES, incident_message

    fused = {c.kind for c in registry.CHECKS if c.fused}
    assert set(SENTENCES) == fused  # the fused kinds' sentences; every other check speaks by its own message()
    for check in registry.CHECKS:
        if not check.fused:
            assert type(check).message is not registry.Check.message, type(check).__name__
    assert incident_message("toy_kind", ["x"], {}, 3, 0) == "toy_kind in `x` at step 3 on rank 0"


def test_the_map_of_sites_slots_and_kinds_covers_every_site_and_names_only_what_exists():
    """``check=[...]`` names sites, the packed read has slots, events have kinds: one map between them."""
    from lightning_numguard.config.validate import SITES as SITE_NAMES
    from lightning_numguard.detect import flags

    assert set(registry.SITES) == set(SITE_NAMES)
    for site in registry.SITES.values():
        assert site.slot in flags.SLOTS
        assert set(site.kinds) <= set(events.KINDS)
    assert {k for s in registry.SITES.values() for k in s.kinds} | {"optimizer_coverage"} >= {
        k for k in events.KINDS if not k.endswith("_spike")
    }

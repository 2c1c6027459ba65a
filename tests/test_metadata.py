"""The package metadata users see (``pip show``, PyPI): URLs, license, entry points, version.

The wheel is built from this checkout with ``pip wheel --no-deps`` (hatchling, in an isolated build
environment) and installed with ``pip install --no-deps --target`` into a temporary folder; the metadata is
then read the way ``pip show`` reads it, with ``importlib.metadata`` on that folder.

``pip show`` prints the ``License-Expression`` field from pip 25.1 on (PEP 639, Metadata 2.4); older pips,
such as the 23.2 bundled with Python 3.11.7, print only the legacy ``License`` field, which a PEP 639
build no longer writes.
"""

from __future__ import annotations

import email
import subprocess
import sys
from importlib.metadata import Distribution
from pathlib import Path

import pytest

from lightning_numguard import __version__

ROOT = Path(__file__).resolve().parents[1]
URL = "https://github.com/lightning-numguard/lightning-numguard"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Distribution:
    tmp = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "-w", str(tmp), str(ROOT)], check=True, capture_output=True, timeout=300
    )
    (wheel,) = tmp.glob("lightning_numguard-*.whl")
    target = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, capture_output=True)
    (dist,) = Distribution.discover(name="lightning-numguard", path=[str(target)])
    return dist


def test_project_urls(installed: Distribution) -> None:
    urls = dict(u.split(", ", 1) for u in installed.metadata.get_all("Project-URL") or [])
    assert urls == {
        "Homepage": URL,
        "Documentation": f"{URL}/tree/main/docs",
        "Changelog": f"{URL}/blob/main/CHANGELOG.md",
        "Issues": f"{URL}/issues",
    }


def test_license_expression_and_file(installed: Distribution) -> None:
    meta = installed.metadata
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    shipped = installed.read_text("licenses/LICENSE") or ""
    assert shipped == (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in shipped


def test_version_entry_points_and_extras(installed: Distribution) -> None:
    assert installed.version == __version__
    groups = {(ep.group, ep.name): ep.value for ep in installed.entry_points}
    assert groups == {
        ("console_scripts", "numguard"): "lightning_numguard.cli:main",
        (
            "pytorch_lightning.callbacks_factory",
            "numguard",
        ): "lightning_numguard.doors.trainer.attach:pytorch_lightning_callbacks",
        (
            "lightning.pytorch.callbacks_factory",
            "numguard",
        ): "lightning_numguard.doors.trainer.attach:lightning_callbacks",
        ("lightning.fabric.callbacks_factory", "numguard"): "lightning_numguard.doors.fabric.attach:fabric_callbacks",
        ("lightning_fabric.callbacks_factory", "numguard"): "lightning_numguard.doors.fabric.attach:fabric_callbacks",
    }
    extras = installed.metadata.get_all("Provides-Extra") or []
    assert {"cli", "dev", "lightning", "litgpt"} <= set(extras)
    litgpt = [r for r in installed.requires or [] if "extra == 'litgpt'" in r]
    assert any(r.startswith("litgpt==0.5.13") for r in litgpt), litgpt
    assert not any(r.startswith("litgpt") for r in installed.requires or [] if "extra" not in r)  # never a runtime dep
    dev = [r for r in installed.requires or [] if "extra == 'dev'" in r]
    assert any(r.startswith("lightning") for r in dev) and any(r.startswith("rich") for r in dev)


def test_metadata_is_what_pip_show_reads(installed: Distribution) -> None:
    """``pip show`` reads METADATA: every field it prints for this package is set."""
    meta = email.message_from_string(installed.read_text("METADATA") or "")
    for field in ("Name", "Version", "Summary", "Author", "License-Expression", "Requires-Dist"):
        assert meta.get(field), field


def test_numguard_version_from_the_command_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lightning_numguard", "--version"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    assert out == f"numguard {__version__}\n"

"""The package surface: every public name resolves, and importing ddpkit stays light."""

from __future__ import annotations

import subprocess
import sys

import ddpkit


def test_all_lists_exactly_the_lazy_exports() -> None:
    assert sorted(ddpkit.__all__) == sorted(["__version__", *ddpkit._EXPORTS])


def test_every_public_name_resolves() -> None:
    for name in ddpkit._EXPORTS:
        assert getattr(ddpkit, name) is not None, name


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        ddpkit.no_such_thing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_does_not_import_torch() -> None:
    code = "import ddpkit, ddpkit.cluster, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_jobs_all_lists_exactly_the_lazy_exports() -> None:
    import ddpkit.jobs

    assert sorted(ddpkit.jobs.__all__) == sorted(ddpkit.jobs._EXPORTS)
    for name in ddpkit.jobs._EXPORTS:
        assert getattr(ddpkit.jobs, name) is not None, name


def test_every_subpackage_is_a_regular_package() -> None:
    # setuptools' find_packages (what a wheel ships) skips folders without __init__.py
    from pathlib import Path

    root = Path(ddpkit.__file__).parent
    for folder in root.rglob("*"):
        if folder.is_dir() and any(folder.glob("*.py")):
            assert (folder / "__init__.py").exists(), f"{folder} has no __init__.py"


def test_dir_lists_each_export_once_also_after_first_use() -> None:
    assert ddpkit.RankInfo is not None  # cached into the namespace now
    names = dir(ddpkit)
    assert len(names) == len(set(names))
    assert set(ddpkit._EXPORTS) <= set(names)

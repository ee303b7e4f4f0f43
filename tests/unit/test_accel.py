"""cachetree.accel: which path runs, how it is forced, what says so, and the optional build."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachetree import accel
from router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
BUILT = importlib.util.find_spec("cachetree._speedups") is not None
needs_build = pytest.mark.skipif(not BUILT, reason="the compiled accelerator is not built")


def test_the_replica_metrics_say_which_implementation_runs() -> None:
    registry = RouterMetrics().registry
    labels = {"implementation": accel.IMPLEMENTATION}
    assert registry.get_sample_value("kvrouter_accelerator_info", labels) == 1
    want = "pure" if accel.FORCED_PURE or not BUILT else "compiled"
    assert want == accel.IMPLEMENTATION


# --- the switch ------------------------------------------------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` in the repo, with `env` instead of this process's KVROUTER_NO_EXTENSIONS."""
    clean = {k: v for k, v in os.environ.items() if k != "KVROUTER_NO_EXTENSIONS"}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _implementation(env: dict[str, str]) -> str:
    done = _python(
        "import cachetree.accel as a, cachetree.keys as k; print(a.IMPLEMENTATION, k._block_keys)",
        **env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("env", "want"),
    [
        pytest.param({}, "compiled <built-in function block_keys>", marks=needs_build),
        pytest.param(
            {"KVROUTER_NO_EXTENSIONS": "0"},
            "compiled <built-in function block_keys>",
            marks=needs_build,
        ),
        ({"KVROUTER_NO_EXTENSIONS": "1"}, "pure <function block_keys_py"),
        ({"KVROUTER_NO_EXTENSIONS": "yes"}, "pure <function block_keys_py"),
    ],
)
def test_kvrouter_no_extensions_forces_the_pure_path(env: dict[str, str], want: str) -> None:
    assert _implementation(env).startswith(want)


def _build_ext(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[Path]]:
    """setup.py's build_ext into `tmp_path`, as pip runs it; returns what it built."""
    script = (
        "import sys; sys.argv = ['setup.py']\n"
        "from setuptools import Distribution\n"
        "import setup\n"
        "dist = Distribution({'ext_modules': setup.extensions(), 'script_name': 'setup.py'})\n"
        "cmd = dist.get_command_obj('build_ext')\n"
        f"cmd.build_lib = {str(tmp_path / 'lib')!r}\n"
        f"cmd.build_temp = {str(tmp_path / 'tmp')!r}\n"
        "dist.run_command('build_ext')\n"
    )
    done = _python(script, **env)
    return done, sorted((tmp_path / "lib").rglob("_*.so"))


def test_a_failed_compile_leaves_a_working_install_on_the_pure_path(tmp_path: Path) -> None:
    """What `pip install` does without a compiler: build_ext warns and goes on (optional=True)."""
    cc = str(tmp_path / "no-such-compiler")
    done, built = _build_ext(tmp_path, CC=cc, LDSHARED=cc)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'building extension "cachetree._speedups" failed' in done.stdout + done.stderr
    assert 'building extension "cachetree._tables" failed' in done.stdout + done.stderr
    assert built == []
    # And an install without the module runs on the pure path, and says why.
    done = _python(
        "import sys; sys.modules['cachetree._speedups'] = None\n"
        "import cachetree.accel as a, cachetree.keys as k\n"
        "print(a.IMPLEMENTATION, k.block_keys(range(1, 33), 16)[1] == 0x0C067075397666B7)\n"
        "print(a.REASON)"
    )
    assert done.returncode == 0, done.stderr
    verdict, reason = done.stdout.splitlines()
    assert verdict == "pure True"  # the pure keys, the pinned value
    assert reason.startswith("the extension is not built")


def test_without_the_compiled_tables_the_tree_takes_the_pure_layout() -> None:
    done = _python(
        "import sys; sys.modules['cachetree._tables'] = None\n"
        "import cachetree.accel as a, cachetree.tree as t\n"
        "print(a.IMPLEMENTATION, t.DEFAULT_LAYOUT.name, t.COMPILED_LAYOUT)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["pure", "pure", "None"]


@needs_build  # where it is built, a compiler is there
def test_the_same_build_with_a_compiler_produces_the_extension(tmp_path: Path) -> None:
    done, built = _build_ext(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [p.name.split(".")[0] for p in built] == ["_speedups", "_tables"]


def test_the_image_builds_the_accelerator_and_fails_without_it() -> None:
    """No Docker daemon here: the Dockerfile is read. Its build stage must have a compiler,
    copy setup.py (and .dockerignore let it in), and import the extension after installing."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    build = dockerfile.split("\nFROM ")[1]  # the stage after the header comment
    assert "gcc" in build and "libc6-dev" in build
    assert "COPY pyproject.toml setup.py" in build
    assert 'python -c "import cachetree._speedups, cachetree._tables"' in build
    assert "!setup.py" in (ROOT / ".dockerignore").read_text().splitlines()

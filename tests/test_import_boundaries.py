"""The import contracts in pyproject.toml hold for the tree, and import-linter catches each kind of breach.

Each breach is a module added to a copy of the tree (never the checkout), so the test proves the contract
would fail CI, not just that today's code happens to pass it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{root / 'platform'}{os.pathsep}{root}"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def copy_tree(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("gpu_workers", "billing", "platform"):
        shutil.copytree(ROOT / package, dest / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_the_tree_keeps_every_import_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


GATEWAY = "The gateway is torch-free"
LAYERS = "Data-plane layers"
# breach -> (module added to the copy, its source, the contract that must break)
BREACHES = {
    "gateway imports torch": ("platform/tessera/api/_probe.py", "import torch\n", GATEWAY),
    "gateway imports the engine": ("platform/tessera/_probe.py", "import gpu_workers.engine\n", GATEWAY),
    "gateway imports the data plane's package face": (
        "platform/tessera/api/_probe.py",
        "from gpu_workers import Engine\n",
        GATEWAY,
    ),
    "a command that is not exempted imports the engine": (
        "platform/tessera/cli/_probe.py",
        "import gpu_workers.engine\n",
        GATEWAY,
    ),
    "a module the gateway imports imports torch": (
        "gpu_workers/grammars.py",
        "import torch\n",
        "What the gateway imports of gpu_workers is torch-free",
    ),
    "data plane imports the control plane": (
        "gpu_workers/kv/_probe.py",
        "import tessera.settings\n",
        "The data plane never imports the control plane",
    ),
    "billing imports the data plane": (
        "billing/_probe.py",
        "import gpu_workers.protocol\n",
        "billing imports",
    ),
    "a lower layer imports a higher one": (
        "gpu_workers/kernels/_probe.py",
        "import gpu_workers.kv.cache\n",
        LAYERS,
    ),
    "request records import the quota configuration": (
        "platform/tessera/records/_probe.py",
        "import tessera.quota_config\n",
        "Control-plane services",
    ),
    "the serving path imports an offline tool": (
        "gpu_workers/engine/_probe.py",
        "import gpu_workers.tools.faults\n",
        LAYERS,
    ),
}


@pytest.mark.parametrize("breach", sorted(BREACHES))
def test_import_linter_fails_on_a_breach(tmp_path, breach):
    root = copy_tree(tmp_path)
    path, source, contract = BREACHES[breach]
    (root / path).write_text(source)
    result = lint_imports(root)
    assert result.returncode != 0, f"{breach} went unnoticed:\n{result.stdout}"
    # Contract names wrap over lines in the report; the broken one is named in its summary block.
    assert contract in result.stdout.split("Broken contracts")[1]


def test_import_linter_fails_on_a_cycle(tmp_path):
    root = copy_tree(tmp_path)
    pkg = root / "billing" / "_cycle"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from billing._cycle import b\n")
    (pkg / "b.py").write_text("from billing._cycle import a\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "No cycles are allowed in billing" in result.stdout

"""The repo's ``platform/`` folder is a source root, not a package: it must never shadow the stdlib ``platform``."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB_PLATFORM = Path(sysconfig.get_paths()["stdlib"]) / "platform.py"


def test_platform_folder_has_no_init_file():
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_python_c_from_repo_root_imports_the_stdlib_platform():
    code = "import platform; platform.system(); print(platform.__file__)"
    # Clear PYTHONPATH so only the repo root, which `python -c` puts first on sys.path, is in play.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == STDLIB_PLATFORM.resolve()


def test_python_m_platform_from_repo_root_runs_the_stdlib_module():
    result = subprocess.run(
        [sys.executable, "-m", "platform"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_platform_under_pytest_sys_path_is_the_stdlib():
    import platform

    # pyproject's pytest `pythonpath` puts both the repo root and the platform/ source root on sys.path.
    assert {str(ROOT), str(ROOT / "platform")} <= {str(Path(p).resolve()) for p in sys.path if p}
    assert platform.system()
    assert Path(platform.__file__).resolve() == STDLIB_PLATFORM.resolve()

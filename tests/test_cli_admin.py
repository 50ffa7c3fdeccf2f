"""``tessera db|tenants|keys|deployments``, run through the real ``tessera.cli.main`` against a real SQLite file."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tessera import auth, cli, db
from tessera.cli import admin as cli_admin

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)


@pytest.fixture
def tessera(monkeypatch, capsys, tmp_path):
    """Run ``tessera ARGS...`` in-process with the data dir under tmp_path; returns exit code, stdout, stderr."""
    original = cli.build_parser

    def build_parser() -> argparse.ArgumentParser:
        parser = original()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if "tenants" not in commands.choices:  # until cli.py registers these commands itself
            cli_admin.add_commands(commands)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser)
    monkeypatch.setenv("TESSERA_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("TESSERA_DATABASE_URL", raising=False)
    auth.key_cache.clear()

    def run(*args: str) -> Result:
        try:
            code = cli.main([str(a) for a in args])
        except SystemExit as exc:  # argparse usage errors
            code = exc.code
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


@pytest.fixture
def migrated(tessera):
    result = tessera("db", "upgrade")
    assert result.code == 0, result.err
    return tessera


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'data' / 'tessera.db'}"


def assert_clean_error(result: Result, *fragments: str) -> None:
    """A user error: non-zero exit, one `tessera: error:` line naming the problem, no traceback."""
    assert result.code != 0
    assert result.err.startswith("tessera: error: ")
    assert "Traceback" not in result.err
    for fragment in fragments:
        assert fragment in result.err


def test_db_upgrade_creates_the_schema_and_a_second_run_changes_nothing(tessera, tmp_path):
    first = tessera("db", "upgrade")
    assert first.code == 0, first.err
    assert f"upgraded from an empty database to revision {db.head_revision()}" in first.out
    second = tessera("db", "upgrade", "--revision", "head")
    assert second.code == 0 and f"already at revision {db.head_revision()}" in second.out
    assert db.current_revision(database_url(tmp_path)) == db.head_revision()


def test_db_downgrade_to_base_drops_the_schema(migrated, tmp_path):
    result = migrated("db", "downgrade", "base")
    assert result.code == 0 and "to base (no tables)" in result.out
    assert db.current_revision(database_url(tmp_path)) is None


def test_an_unknown_revision_is_a_clear_error(migrated):
    assert_clean_error(
        migrated("db", "downgrade", "nonsense"), "Can't locate revision identified by 'nonsense'"
    )


def test_commands_on_an_unmigrated_database_say_to_run_db_upgrade(tessera):
    assert_clean_error(tessera("tenants", "list"), "has no Tessera tables", "run `tessera db upgrade` first")


def test_an_unreachable_database_is_a_clear_error(tessera):
    result = tessera("tenants", "list", "--database-url", "postgresql://nobody@127.0.0.1:1/none")
    assert_clean_error(result, "postgresql://nobody@127.0.0.1:1/none", "Connection refused", "is running")


def test_database_url_flag_overrides_the_environment(tessera, tmp_path):
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert tessera("db", "upgrade", "--database-url", other).code == 0
    assert db.current_revision(other) == db.head_revision()
    assert db.current_revision(database_url(tmp_path)) is None


def test_tenants_create_list_disable_enable(migrated):
    created = migrated("tenants", "create", "acme", "--json")
    assert created.code == 0 and created.json()["name"] == "acme"
    assert migrated("tenants", "create", "beta").code == 0
    listed = migrated("tenants", "list", "--json")
    assert [json.loads(line)["name"] for line in listed.out.splitlines()] == ["acme", "beta"]
    assert migrated("tenants", "disable", "acme", "--json").json()["disabled"] is True
    assert migrated("tenants", "enable", "acme", "--json").json()["disabled"] is False
    table = migrated("tenants", "list")
    assert "acme" in table.out and "beta" in table.out


def test_tenant_errors_are_clear(migrated):
    migrated("tenants", "create", "acme")
    assert_clean_error(migrated("tenants", "create", "acme"), "tenant 'acme' already exists")
    assert_clean_error(migrated("tenants", "create", "no spaces"), "invalid tenant name 'no spaces'")
    assert_clean_error(migrated("tenants", "disable", "ghost"), "no tenant named 'ghost'")


def test_the_key_is_printed_once_and_only_its_hash_is_stored(migrated, tmp_path):
    migrated("tenants", "create", "acme")
    created = migrated("keys", "create", "--tenant", "acme", "--name", "laptop")
    assert created.code == 0, created.err
    raw = created.out.strip()
    assert auth.parse_prefix(raw) is not None and created.out == raw + "\n"  # stdout: just the key
    assert "shown only once" in created.err and "cannot show it again" in created.err

    listed = migrated("keys", "list", "--tenant", "acme", "--json")
    assert raw.split("_", 2)[2] not in listed.out
    row = listed.json()
    assert (row["prefix"], row["name"], row["scopes"]) == (raw[:12], "laptop", "inference")
    assert raw.split("_", 2)[2] not in (tmp_path / "data" / "tessera.db").read_bytes().decode("latin-1")

    engine = db.make_engine(database_url(tmp_path))
    with db.session_factory(engine)() as session:
        assert auth.verify_key(session, raw).tenant.name == "acme"
    engine.dispose()


def test_admin_keys_get_the_admin_scope_and_json_carries_the_key(migrated):
    migrated("tenants", "create", "ops")
    created = migrated("keys", "create", "--tenant", "ops", "--admin", "--json")
    assert created.code == 0, created.err
    data = created.json()
    assert data["scopes"] == "inference,admin" and data["key"].startswith(data["prefix"] + "_")
    assert "shown only once" in created.err


def test_a_revoked_key_no_longer_verifies(migrated, tmp_path):
    migrated("tenants", "create", "acme")
    raw = migrated("keys", "create", "--tenant", "acme").out.strip()
    revoked = migrated("keys", "revoke", raw[:12], "--json")
    assert revoked.code == 0 and revoked.json()["revoked_at"] is not None
    engine = db.make_engine(database_url(tmp_path))
    with db.session_factory(engine)() as session:
        assert auth.verify_key(session, raw) is None
    engine.dispose()
    assert_clean_error(migrated("keys", "revoke", "tsk_zzzzzzzz"), "no API key with prefix 'zzzzzzzz'")
    assert_clean_error(migrated("keys", "create", "--tenant", "ghost"), "no tenant named 'ghost'")


def test_deployments_create_show_update_and_audit(migrated, checkpoint):
    created = migrated(
        "deployments", "create", "@tessera/demo", "--checkpoint", checkpoint, "--decode-kv", "bf16",
        "--kv-budget-bytes", "512MiB", "--max-model-len", "8192", "--no-prefix-cache", "--json",
    )  # fmt: skip
    assert created.code == 0, created.err
    data = created.json()
    assert (data["decode_kv"], data["kv_budget_bytes"], data["max_model_len"]) == ("bf16", 512 * 2**20, 8192)
    assert (data["prefix_cache"], data["integrity_check"], data["enabled"]) == (False, True, True)
    assert data["audit"][0]["action"] == "create" and data["audit"][0]["actor"].startswith("cli")

    updated = migrated(
        "deployments", "update", "@tessera/demo", "--page-size", "32", "--disable", "--max-model-len", "auto",
        "--local-prefill-max-tokens", "128", "--json",
    )  # fmt: skip
    assert updated.code == 0, updated.err
    data = updated.json()
    assert (data["page_size"], data["enabled"], data["max_model_len"]) == (32, False, None)
    assert data["local_prefill_max_tokens"] == 128
    assert data["audit"][0]["changes"] == {
        "page_size": [16, 32],
        "max_model_len": [8192, None],
        "local_prefill_max_tokens": [0, 128],
        "enabled": [True, False],
    }

    shown = migrated("deployments", "show", "@tessera/demo", "--json").json()
    assert [a["action"] for a in shown["audit"]] == ["update", "create"]
    listed = migrated("deployments", "list", "--json")
    assert [json.loads(line)["name"] for line in listed.out.splitlines()] == ["@tessera/demo"]
    table = migrated("deployments", "show", "@tessera/demo")
    assert table.code == 0 and "Changes (newest first)" in table.out and "@tessera/demo" in table.out


def test_an_update_that_changes_nothing_says_so(migrated, checkpoint):
    migrated("deployments", "create", "m", "--checkpoint", checkpoint)
    result = migrated("deployments", "update", "m", "--page-size", "16", "--json")
    assert result.code == 0 and "No change" in result.err and result.json()["audit"] == []


def test_invalid_deployment_config_exits_nonzero_with_every_problem(migrated, checkpoint):
    migrated("deployments", "create", "m", "--checkpoint", checkpoint)
    result = migrated("deployments", "update", "m", "--page-size", "24", "--decode-kv", "fp4")
    assert_clean_error(result, "page_size: must be a power of two", "decode_kv: Input should be")
    assert_clean_error(migrated("deployments", "update", "m"), "nothing to update")
    assert_clean_error(migrated("deployments", "show", "ghost"), "no deployment named 'ghost'")
    assert_clean_error(migrated("deployments", "create", "m", "--checkpoint", checkpoint), "already exists")


def test_a_checkpoint_only_on_the_workers_needs_the_check_skipped(migrated, tmp_path):
    remote = tmp_path / "on-gpu-hosts"
    assert_clean_error(migrated("deployments", "create", "m", "--checkpoint", remote), "has no config.json")
    result = migrated("deployments", "create", "m", "--checkpoint", remote, "--no-checkpoint-check", "--json")
    assert result.code == 0 and result.json()["checkpoint"] == str(remote)


def test_bad_flag_values_are_usage_errors(migrated, checkpoint):
    result = migrated("deployments", "create", "m", "--checkpoint", checkpoint, "--kv-budget-bytes", "12XB")
    assert result.code == 2 and "expected a byte count like 268435456, 512MiB or 8GiB" in result.err


def test_tables_are_printed_without_json(migrated, checkpoint):
    migrated("deployments", "create", "@tessera/demo", "--checkpoint", checkpoint)
    result = migrated("deployments", "list")
    assert result.code == 0 and "@tessera/demo" in result.out and "disaggregated" in result.out


def test_importing_the_admin_cli_stays_light():
    # tessera.cli imports cli.admin for every `tessera` command: SQLAlchemy, alembic and rich load only when used.
    code = "import sys, tessera.cli.admin; print(sorted(m for m in ('sqlalchemy', 'alembic', 'rich') if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- quotas ------------------------------------------------------------------------------------------------


TOKEN_COLUMNS = ("scope", "rpm", "tpm", "concurrency", "daily_tokens", "monthly_tokens")


def _quota_rows(result: Result) -> list[dict]:
    """The request and token limits of each row (spend budgets are test_budgets.py's)."""
    assert result.code == 0, result.err
    return [{k: row[k] for k in TOKEN_COLUMNS} for row in map(json.loads, result.out.splitlines())]


def test_quotas_set_changes_only_the_named_limits_and_show_lists_key_overrides(migrated, tmp_path):
    assert migrated("tenants", "create", "acme").code == 0
    key = migrated("keys", "create", "--tenant", "acme", "--json").json()["prefix"]
    assert _quota_rows(migrated("quotas", "show", "--tenant", "acme", "--json")) == [
        {
            "scope": "tenant",
            "rpm": None,
            "tpm": None,
            "concurrency": None,
            "daily_tokens": None,
            "monthly_tokens": None,
        }
    ]
    migrated("quotas", "set", "--tenant", "acme", "--rpm", "60", "--tpm", "10000")
    rows = _quota_rows(migrated("quotas", "set", "--tenant", "acme", "--concurrency", "4", "--json"))
    assert rows == [
        {
            "scope": "tenant",
            "rpm": 60,
            "tpm": 10000,
            "concurrency": 4,
            "daily_tokens": None,
            "monthly_tokens": None,
        }
    ]
    rows = _quota_rows(migrated("quotas", "set", "--tenant", "acme", "--key", key, "--rpm", "5", "--json"))
    assert rows[1]["scope"] == f"key {key}" and (rows[1]["rpm"], rows[1]["tpm"]) == (5, 10000)
    rows = _quota_rows(migrated("quotas", "set", "--tenant", "acme", "--rpm", "none", "--json"))
    assert rows[0]["rpm"] is None and rows[0]["tpm"] == 10000
    table = migrated("quotas", "show", "--tenant", "acme")
    assert table.code == 0 and "10000" in table.out and key in table.out

    from tessera import quota_config
    from tessera.limits import Limits

    engine = db.make_engine(database_url(tmp_path))
    with db.session_factory(engine)() as session:
        assert quota_config.get_limits(session, "acme") == Limits(tpm=10000, concurrency=4)
        assert quota_config.get_key_limits(session, key) == Limits(rpm=5)
    engine.dispose()


@pytest.mark.parametrize(
    "args",
    [
        ("quotas", "set", "--tenant", "acme"),  # no limit named
        ("quotas", "set", "--tenant", "acme", "--rpm", "-1"),
        ("quotas", "set", "--tenant", "acme", "--tpm", "lots"),
        ("quotas", "set", "--rpm", "5"),  # no tenant
    ],
)
def test_quotas_set_with_bad_arguments_exits_2(migrated, args):
    assert migrated("tenants", "create", "acme").code == 0
    result = migrated(*args)
    assert result.code == 2 and "Traceback" not in result.err


def test_quotas_of_unknown_tenants_and_other_tenants_keys_are_clear_errors(migrated):
    for name in ("acme", "beta"):
        assert migrated("tenants", "create", name).code == 0
    other = migrated("keys", "create", "--tenant", "beta", "--json").json()["prefix"]
    assert_clean_error(migrated("quotas", "show", "--tenant", "nobody"), "no tenant named 'nobody'")
    assert_clean_error(
        migrated("quotas", "set", "--tenant", "acme", "--key", other, "--rpm", "1"), "has no API key"
    )

"""``tessera bench matrix``: its arithmetic (held concurrency, cost per million tokens, what counts as
queueing, which runs the axes share), and a small run against a real ``tessera up``: every configuration was
served by workers reporting it, token counts are the server's and the ledger's, the config is restored."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
from tessera.bench.matrix import (
    AXES,
    CONFIG_FIELDS,
    MatrixSpec,
    cost_per_million,
    figures,
    held_concurrency,
    plan,
    queued,
)
from tessera.bench.schemas import validate
from tessera.launcher import DEFAULT_MODEL

from gpu_workers.protocol import EXIT_RELOAD


def level(concurrency: int, held: bool) -> dict:
    return {"concurrency": concurrency, "held": held}


def test_held_concurrency_is_the_highest_level_with_every_lower_level_held():
    assert held_concurrency([level(1, True), level(8, True), level(16, False), level(32, False)]) == 8
    assert held_concurrency([level(32, True), level(1, True), level(8, True)]) == 32  # any order
    # A level held above one that was not does not count: the deployment ran out below it.
    assert held_concurrency([level(1, True), level(8, False), level(16, True)]) == 1
    assert held_concurrency([level(1, False), level(8, True)]) is None


def test_cost_per_million_output_tokens_from_worker_seconds():
    # 2 workers at $3.60/h for 10 s: $0.02 for 4,000 tokens -> $5 per million.
    assert cost_per_million(3.6, 2, 10.0, 4000) == pytest.approx(5.0)
    # Twice the tokens in the same worker-seconds halve it; no tokens, no figure.
    assert cost_per_million(3.6, 2, 10.0, 8000) == pytest.approx(2.5)
    assert cost_per_million(3.6, 2, 10.0, 0) is None


def worker(waiting: int, used: int, total: int = 100, running: int = 4) -> dict:
    return {"waiting": waiting, "kv_pages_used": used, "kv_pages_total": total, "running": running}


def test_queued_means_waiting_for_pages_or_a_batch_slot_not_for_the_next_step():
    assert not queued(worker(0, 100), pages_needed=9, max_num_seqs=64)
    assert not queued(worker(2, 50), pages_needed=9, max_num_seqs=64)  # room: admitted next step
    assert queued(worker(1, 95), pages_needed=9, max_num_seqs=64)  # 5 free pages, a prompt needs 9
    assert queued(worker(1, 10, running=64), pages_needed=9, max_num_seqs=64)  # every slot taken


def test_axes_share_runs_and_the_served_config_goes_first():
    original = {
        "dtype": "auto",
        "kv_budget_bytes": 2**20,
        "decode_kv": "fp8_e4m3",
        "prefill_weights": "bf16",
        "decode_weights": "bf16",
        "integrity_check": True,
        "prefix_cache": True,
    }
    spec = MatrixSpec("u", "a", "k", "m", ["kv", "integrity", "prefix"], [1], 16, 4)
    runs, of = plan(spec, original)
    # kv=fp8_e4m3 and integrity=on are the deployment as it is (one run, first); prefix has its own load.
    assert of[("kv", "fp8_e4m3")] == of[("integrity", "on")] == 0
    assert runs[0].config == original and not runs[0].shared_prefix
    assert (
        len(runs) == 6
    )  # served, bf16 KV, int8 KV, integrity off, prefix on and off under the shared prompt
    assert runs[of[("prefix", "on")]].shared_prefix and runs[of[("prefix", "on")]].config == original
    # A fixed budget applies to every run, so none is the served config any more.
    runs, _ = plan(MatrixSpec("u", "a", "k", "m", ["kv"], [1], 16, 4, kv_budget_bytes=3 * 2**20), original)
    assert {r.config["kv_budget_bytes"] for r in runs} == {3 * 2**20}
    assert [r.config["decode_kv"] for r in runs] == ["bf16", "int8", "fp8_e4m3"]
    # Runs of one config under two workloads follow each other: one reload for both.
    budget = MatrixSpec("u", "a", "k", "m", ["kv", "prefix"], [1], 16, 4, kv_budget_bytes=3 * 2**20)
    runs, _ = plan(budget, original)
    shape = [(r.config["decode_kv"], r.config["prefix_cache"], r.shared_prefix) for r in runs]
    assert shape == [
        ("bf16", True, False),
        ("int8", True, False),
        ("fp8_e4m3", True, False),
        ("fp8_e4m3", True, True),
        ("fp8_e4m3", False, True),
    ]


def test_mode_axis_without_a_second_deployment_is_refused_with_the_reason():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    command = [sys.executable, "-m", "tessera.cli", "bench", "matrix", "--url", "http://127.0.0.1:9"]
    command += ["--admin-key", "a", "--api-key", "k", "--model", DEFAULT_MODEL, "--axes", "kv,mode"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "the mode axis needs --mode-deployment NAME" in done.stderr
    assert "a worker refuses a pool its deployment's mode does not have" in done.stderr
    done = subprocess.run([*command[:-1], "kv,speed"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--axes takes a comma-separated subset" in done.stderr
    done = subprocess.run(
        [*command[:-1], "kv", "--mode-deployment", "@x/y"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and "add mode to --axes" in done.stderr


def test_mode_axis_runs_each_mode_on_its_own_deployment_with_one_config():
    original = {
        "dtype": "float32",
        "kv_budget_bytes": 2**20,
        "decode_kv": "fp8_e4m3",
        "prefill_weights": "bf16",
        "decode_weights": "bf16",
        "integrity_check": True,
        "prefix_cache": True,
    }
    spec = MatrixSpec("u", "a", "k", "d", ["kv", "mode"], [1], 16, 4, kv_budget_bytes=3 * 2**20)
    runs, of = plan(spec, original, {"disaggregated": "d", "colocated": "c"})
    # The disaggregated variant is the kv axis' fp8 run (one config, one deployment): measured once.
    assert of[("mode", "disaggregated")] == of[("kv", "fp8_e4m3")]
    colocated = runs[of[("mode", "colocated")]]
    assert colocated.deployment == "c" and colocated.config == runs[of[("kv", "fp8_e4m3")]].config
    assert len(runs) == 4 and {r.deployment for r in runs} == {"d", "c"}


# --- against tessera up ----------------------------------------------------------------------------------------

BUDGET = 3 * 2**20
CONCURRENCY = (1, 3)
PER_CLIENT = 2
OUTPUT_LEN = 8
REPEATS = 2


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    from test_launcher import assert_all_stopped, start_up, stop_up

    up = start_up(tmp_path_factory.mktemp("matrix"))
    yield up
    assert stop_up(up, signal.SIGTERM) == 0, up.output
    assert_all_stopped(up)


def admin_get(up, path: str, **params) -> dict:
    headers = {"Authorization": f"Bearer {up.key}"}
    response = httpx.get(f"{up.url}{path}", headers=headers, params=params, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def ledger_usage(up) -> dict:
    rows = admin_get(up, "/v1/usage", group_by="model")["data"]
    return next((r for r in rows if r["model"] == DEFAULT_MODEL), {"requests": 0, "output_tokens": 0})


@pytest.mark.slow
def test_matrix_serves_each_configuration_counts_the_servers_tokens_and_restores_the_config(up, tmp_path):
    fields = ("dtype", "kv_budget_bytes", "decode_kv", "integrity_check", "prefix_cache", "decode_weights")
    original = admin_get(up, f"/admin/deployments/{DEFAULT_MODEL}")
    out = tmp_path / "matrix.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    command = [sys.executable, "-m", "tessera.cli", "bench", "matrix", "--url", up.url]
    command += ["--admin-key", up.key, "--api-key", up.key, "--model", DEFAULT_MODEL]
    # One pair of configurations: every run is a PATCH of the whole config and a reload, whatever its axis, so
    # more runs add reloads, not code. How axes share runs is the plan test's; what each KV format serves,
    # test_config_reload.py's and test_kv_formats.py's. The integrity axis: its table adds the overhead line.
    # No --kv-budget-bytes (the stop test applies one): the served config is a run, first, without a reload.
    command += ["--axes", "integrity", "--concurrency", ",".join(map(str, CONCURRENCY))]
    command += [
        "--input-len",
        "40",
        "--output-len",
        str(OUTPUT_LEN),
        "--requests-per-client",
        str(PER_CLIENT),
    ]
    command += ["--repeats", str(REPEATS), "--json", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{up.output}"
    assert "KV integrity check" in done.stdout and "integrity check overhead at peak:" in done.stdout
    assert "x (" in done.stdout and "–" in done.stdout  # ratios print "mean (low–high)"
    report = json.loads(out.read_text())
    validate(report, "matrix")  # the documented schema; a wrong copy fails it
    for path, wrong in ((("runs", 0, "levels", 0, "held"), "yes"), (("axes", "integrity", "ratios"), None)):
        broken = copy.deepcopy(report)
        *parents, last = path
        target = broken
        for key in parents:
            target = target[key]
        target[last] = wrong
        with pytest.raises(jsonschema.ValidationError) as failed:
            validate(broken, "matrix")
        assert tuple(failed.value.absolute_path) == path
    # Integrity on (the served config, first: no reload), then off
    assert report["repeats"] == REPEATS and len(report["runs"]) == 2
    assert report["runs"][0]["config"] == report["original_config"] and original["integrity_check"]
    assert report["axes"]["integrity"]["variants"] == {"off": 1, "on": 0}

    # Each variant ran on workers that reported serving exactly its config, before and after its load, in
    # every repeat; only the axis' field differs from the served config.
    for variant in AXES["integrity"].variants:
        run = report["runs"][report["axes"]["integrity"]["variants"][variant.name]]
        config = run["config"]
        assert config == {**report["original_config"], **variant.changes}
        for repeat in run["repeats"]:
            for served in (repeat["served"], repeat["served_after"]):
                assert served["decode"]["kv_formats"] == [config["decode_kv"]]
                for pool in ("prefill", "decode"):
                    assert served[pool]["live_workers"] == 1
                    assert served[pool]["integrity_check"] == [config["integrity_check"]]
                    assert served[pool]["config_versions"] == [repeat["config_version"]]

    # Interleaved: every configuration once per repeat, in the same order (A B, A B), each with fresh prompts.
    ran = sorted(
        (rep["started_s"], rep["ended_s"], rep["repeat"], i)
        for i, run in enumerate(report["runs"])
        for rep in run["repeats"]
    )
    assert [(r, i) for _, _, r, i in ran] == [(r, i) for r in range(REPEATS) for i in range(2)]
    assert all(a[1] <= b[0] for a, b in zip(ran, ran[1:], strict=False))  # one at a time
    assert len({rep["seed"] for run in report["runs"] for rep in run["repeats"]}) == REPEATS

    # Every level, of every repeat and pooled: all sent requests accounted for, exactly output_len tokens each,
    # ordered percentiles.
    for run in report["runs"]:
        for part, repeats in ((run, REPEATS), *((rep, 1) for rep in run["repeats"])):
            assert [lv["concurrency"] for lv in part["levels"]] == list(CONCURRENCY)
            for lv in part["levels"]:
                failed = sum(lv["failures"].values())
                assert lv["requests"] == lv["concurrency"] * PER_CLIENT * repeats == lv["completed"] + failed
                assert failed == 0, lv["failures"]
                assert lv["output_tokens"] == lv["completed"] * OUTPUT_LEN
                for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
                    assert lv[metric]["p50"] <= lv[metric]["p95"] <= lv[metric]["p99"]
                assert lv["heartbeats_seen"] >= 1
            assert part["held_concurrency"] in (None, *CONCURRENCY)
            assert part["peak_output_throughput"] == max(lv["output_throughput"] for lv in part["levels"])
            assert part["cost_per_mtok_usd"] > 0
        # Pooled held is held in every repeat.
        for i, lv in enumerate(run["levels"]):
            assert lv["held"] == all(rep["levels"][i]["held"] for rep in run["repeats"])
        # Intervals: each figure's per-repeat values, their mean inside its interval.
        per_repeat = [figures(rep) for rep in run["repeats"]]
        assert set(run["stats"]) == set(per_repeat[0]) >= {"output_throughput@3", "ttft_ms.p95@1"}
        for name, stat in run["stats"].items():
            assert stat["values"] == [pytest.approx(f[name], abs=1e-4) for f in per_repeat]
            assert stat["ci95"][0] <= stat["mean"] <= stat["ci95"][1]
    # Ratios against the baseline are paired by repeat: the mean of repeat-by-repeat ratios.
    integrity = report["axes"]["integrity"]
    on, off = (report["runs"][integrity["variants"][n]]["repeats"] for n in ("on", "off"))
    peak = integrity["ratios"]["on"]["peak_output_throughput"]
    paired = [a["peak_output_throughput"] / b["peak_output_throughput"] for a, b in zip(on, off, strict=True)]
    assert peak["values"] == [pytest.approx(r, abs=1e-4) for r in paired]
    assert peak["mean"] == pytest.approx(sum(paired) / REPEATS, abs=1e-4)

    # The client's token counts are the server's usage, and the ledger holds the same.
    totals = report["totals"]
    assert totals["completed"] == totals["requests"]
    deadline = time.monotonic() + 60
    while (ledger := ledger_usage(up))["output_tokens"] < totals[
        "output_tokens"
    ] and time.monotonic() < deadline:
        time.sleep(1)
    assert ledger["requests"] == totals["requests"]
    assert ledger["output_tokens"] == totals["output_tokens"]
    assert ledger["input_tokens"] == totals["prompt_tokens"]

    # The deployment is back on its original config, and its workers serve it.
    restored = admin_get(up, f"/admin/deployments/{DEFAULT_MODEL}")
    assert {k: restored[k] for k in fields} == {k: original[k] for k in fields}
    assert report["restored_config"] == report["original_config"]
    decode = next(
        p
        for p in admin_get(up, "/admin/pools")["data"]
        if p["deployment"] == DEFAULT_MODEL and p["pool"] == "decode"
    )
    assert decode["kv_formats"] == [original["decode_kv"]]
    assert all(not w["draining"] for w in decode["workers"])


COLOCATED = "@tessera/pycode-tiny-colocated"


@contextlib.contextmanager
def colocated_deployment(up, log_path):
    """The default model's checkpoint deployed colocated beside tessera up's disaggregated one, and its serve
    worker, restarted on a config change (exit EXIT_RELOAD) the way a supervisor does. Its config is the
    default's but for kv_budget_bytes (BUDGET): the matrix changes only the colocated one, and restores it."""
    default = admin_get(up, f"/admin/deployments/{DEFAULT_MODEL}")
    body = {
        k: default[k]
        for k in (
            "checkpoint",
            "page_size",
            "max_num_seqs",
            "max_model_len",
            "max_tokens_limit",
            *CONFIG_FIELDS,
        )
    }
    body["kv_budget_bytes"] = BUDGET
    headers = {"Authorization": f"Bearer {up.key}"}
    created = httpx.post(
        f"{up.url}/admin/deployments", json={**body, "name": COLOCATED, "mode": "colocated"}, headers=headers
    )
    assert created.status_code in (201, 409), created.text
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env |= {"TESSERA_DATA_DIR": str(up.data_dir), "TESSERA_REDIS_URL": f"redis+socket://{up.redis_socket}"}
    worker = [sys.executable, "-m", "tessera.cli", "worker", "--deployment", COLOCATED, "--pool", "serve"]
    loop = f"while :; do {shlex.join(worker)}; [ $? -eq {EXIT_RELOAD} ] || exit; done"
    with open(log_path, "w") as log:
        process = subprocess.Popen(["bash", "-c", loop], env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not any(
            p["deployment"] == COLOCATED and p["live_workers"] for p in admin_get(up, "/admin/pools")["data"]
        ):
            assert process.poll() is None, Path(log_path).read_text()
            assert time.monotonic() < deadline, "the colocated worker was not live in 180 s"
            time.sleep(0.5)
        yield
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the loop and the worker it runs: a group of its own
        process.wait(timeout=60)


def usage_by_model(up) -> dict[str, dict]:
    return {r["model"]: r for r in admin_get(up, "/v1/usage", group_by="model")["data"]}


@pytest.mark.slow
def test_matrix_mode_axis_compares_a_colocated_and_a_disaggregated_deployment(up, tmp_path):
    with colocated_deployment(up, tmp_path / "colocated-worker.log"):
        originals = {n: admin_get(up, f"/admin/deployments/{n}") for n in (DEFAULT_MODEL, COLOCATED)}
        before = usage_by_model(up)
        out = tmp_path / "mode.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
        command = [sys.executable, "-m", "tessera.cli", "bench", "matrix", "--url", up.url]
        command += ["--admin-key", up.key, "--api-key", up.key, "--model", DEFAULT_MODEL]
        command += ["--axes", "mode", "--mode-deployment", COLOCATED, "--concurrency", "1,2"]
        command += ["--input-len", "24", "--output-len", "4", "--requests-per-client", "2"]
        # No --kv-budget-bytes: the disaggregated deployment's own config is the run's, so only the colocated
        # one reloads (to it, and back), not both of them twice.
        command += ["--repeats", "2", "--json", str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (
            f"{done.stdout}\n{done.stderr}\n{(tmp_path / 'colocated-worker.log').read_text()}"
        )
        report = json.loads(out.read_text())
        totals = report["totals"]
        deadline = time.monotonic() + 60
        while True:
            after = usage_by_model(up)
            sent = {
                k: sum(
                    after.get(m, {}).get(k, 0) - before.get(m, {}).get(k, 0)
                    for m in (DEFAULT_MODEL, COLOCATED)
                )
                for k in ("requests", "input_tokens", "output_tokens")
            }
            if sent["output_tokens"] >= totals["output_tokens"] or time.monotonic() > deadline:
                break
            time.sleep(1)
        restored = {n: admin_get(up, f"/admin/deployments/{n}") for n in (DEFAULT_MODEL, COLOCATED)}
    validate(report, "matrix")
    assert "serving mode" in done.stdout
    axis = report["axes"]["mode"]
    runs = {name: report["runs"][i] for name, i in axis["variants"].items()}
    assert (
        runs["disaggregated"]["deployment"] == DEFAULT_MODEL and runs["colocated"]["deployment"] == COLOCATED
    )
    assert runs["disaggregated"]["config"] == runs["colocated"]["config"]  # one config, two modes
    # The disaggregated deployment's, applied to the colocated one, which served another before and after.
    assert runs["colocated"]["config"] == report["original_config"]
    assert report["mode_deployment"]["original_config"] == {
        **report["original_config"],
        "kv_budget_bytes": BUDGET,
    }
    for name, pools, workers in (("disaggregated", {"prefill", "decode"}, 2), ("colocated", {"serve"}, 1)):
        run = runs[name]
        assert run["mode"] == name and run["workers"] == workers
        for repeat in run["repeats"]:
            assert set(repeat["served"]) == pools  # the workers that served it were that mode's
            assert all(p["live_workers"] == 1 for p in repeat["served"].values())
        for lv in run["levels"]:
            assert lv["completed"] == lv["requests"] == lv["concurrency"] * 2 * 2
            assert lv["output_tokens"] == lv["completed"] * 4
        assert run["stats"]["output_throughput@2"]["ci95"] is not None
    ratio = axis["ratios"]["colocated"]["peak_output_throughput"]
    paired = [c["peak_output_throughput"] / d["peak_output_throughput"]
              for c, d in zip(runs["colocated"]["repeats"], runs["disaggregated"]["repeats"], strict=True)]  # fmt: skip
    assert ratio["values"] == [pytest.approx(r, abs=1e-4) for r in paired]
    # Interleaved: disaggregated, colocated, disaggregated, colocated.
    ran = sorted((rep["started_s"], name) for name, run in runs.items() for rep in run["repeats"])
    assert [name for _, name in ran] == ["disaggregated", "colocated"] * 2
    # Every request reached the ledger under its deployment's model, with the server's token counts.
    assert sent == {
        "requests": totals["requests"],
        "input_tokens": totals["prompt_tokens"],
        "output_tokens": totals["output_tokens"],
    }
    assert totals["completed"] == totals["requests"]
    # Both deployments are back on their original configs.
    for name in (DEFAULT_MODEL, COLOCATED):
        assert {k: restored[name][k] for k in report["original_config"]} == {
            k: originals[name][k] for k in report["original_config"]
        }
    assert report["mode_deployment"]["restored_config"] == report["mode_deployment"]["original_config"]


# Last in the module, so the tests above begin from a finished reload: this one stops the matrix while its
# workers reload. (Its change and the restore right after it once left two workers in the pool; a worker made
# stale now stays stale and leaves, pools/worker.py, held by test_config_reload.py.)
@pytest.mark.slow
def test_matrix_stopped_mid_run_restores_the_original_config(up):
    fields = ("kv_budget_bytes", "decode_kv", "integrity_check")
    original = admin_get(up, f"/admin/deployments/{DEFAULT_MODEL}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    command = [sys.executable, "-m", "tessera.cli", "bench", "matrix", "--url", up.url]
    command += ["--admin-key", up.key, "--api-key", up.key, "--model", DEFAULT_MODEL, "--axes", "kv"]
    command += ["--concurrency", "1", "--input-len", "16", "--output-len", "4"]
    command += ["--kv-budget-bytes", str(BUDGET + 2**20)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        # Stopped once its first change is committed: while its workers reload, or under load.
        while admin_get(up, f"/admin/deployments/{DEFAULT_MODEL}")["kv_budget_bytes"] != BUDGET + 2**20:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the matrix made no change in 300 s"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, f"{stdout}\n{stderr}"
    assert "restoring the original config" in stderr
    restored = admin_get(up, f"/admin/deployments/{DEFAULT_MODEL}")
    assert {k: restored[k] for k in fields} == {k: original[k] for k in fields}

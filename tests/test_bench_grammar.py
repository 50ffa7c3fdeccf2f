"""``tessera bench grammar`` at a tiny size: the report's fields, and every mask both libraries computed allowed
the generated document's next token (a mask that forbids a valid token would make constrained decoding emit
something else). No timing is asserted: these machines are shared and noisy."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from tessera.bench.grammar import LIBRARIES, SCHEMAS, _allows, instance
from tessera.cli import main


def run_bench(capsys, *args: str) -> dict:
    code = main(["bench", "grammar", "--repeat", "2", "--threads", "1", "--json", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_generated_documents_conform_to_their_schema(name):
    for seed in range(8):
        jsonschema.validate(instance(SCHEMAS[name], random.Random(seed)), SCHEMAS[name])


def test_mask_check_catches_a_forbidden_token():
    bitmask = torch.full((2, 49152 // 32), -1, dtype=torch.int32)
    bitmask[1, 100 >> 5] &= ~(1 << (100 & 31))
    assert _allows(bitmask, [100, 100]) == [True, False]
    assert _allows(bitmask, [100, 101]) == [True, True]


def test_every_mask_allows_the_documents_next_token(capsys):
    report = run_bench(capsys, "--schemas", "flat_scalars,tool_call_anyof_3", "--rows", "1,4", "--max-steps", "12", "--apply-rows", "")  # fmt: skip
    assert report["problem_count"] == 0, report["problems"]
    assert list(report["schemas"]) == ["flat_scalars", "tool_call_anyof_3"]
    for entry in report["schemas"].values():
        assert entry["document_tokens"] > 12
        for lib in LIBRARIES:
            e = entry["libraries"][lib]
            assert e["ready_ms"]["mean"] > 0 and len(e["ready_ms"]["values"]) == 2
            assert e["mean_allowed_tokens"] >= 1
            for rows in (1, 4):
                walk = e[f"rows_{rows}"]
                assert walk["steps"] == 12
                assert walk["mask_mean_us"]["mean"] > 0
                assert walk["mask_p95_us"]["mean"] >= walk["mask_mean_us"]["mean"] * 0.5
        assert entry["ll_over_xgr"]["rows_4_mask_mean"]["mean"] > 0
    assert report["overall"]["ll_over_xgr"]["rows_1_mask_mean_us"]["mean"] > 0
    assert report["apply_us"] == {}


@pytest.mark.slow  # llguidance's mask application is torch.compile'd: tens of seconds on a cold cache
def test_mask_application_agrees_across_libraries(capsys):
    report = run_bench(
        capsys, "--schemas", "flat_scalars", "--rows", "2", "--max-steps", "4", "--apply-rows", "3"
    )
    assert report["problem_count"] == 0, report["problems"]
    applied = report["apply_us"]["3"]
    for variant in ("llguidance", "xgrammar", "torch"):
        assert applied[variant]["mean_us"]["mean"] > 0
    assert applied["ll_over_xgr"]["mean"] > 0

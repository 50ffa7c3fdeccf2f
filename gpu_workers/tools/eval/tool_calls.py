"""``tessera eval tools``: the tool-call suite (``tool_suite``) sent through a running Tessera API with the
OpenAI SDK, per deployment and mode, scored as the share of calls that parse and validate against their
tool's schema, the share of cases that call the expected tool, and the share whose call holds the expected
arguments, each with a 95% Wilson interval; optionally every case again streamed, compared with the
non-streamed answer.

Modes: ``unconstrained`` (tool_choice auto, every tool ``strict: false``: nothing enforced, the model's own
calls as the API parses them), ``auto`` (the default: a call is constrained once the model starts one) and
``required`` (a call is forced and constrained). Answers are asked with logprobs, so a streamed answer that
differs from the non-streamed one can be told apart: other tokens (the generation differed) or the same
tokens written otherwise (the stream's fault). Every case expects one call, so it is sent with
``parallel_tool_calls: false``: a second call cut by ``max_tokens`` would count against the first.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpu_workers.tools.eval.tool_suite import CASES, TOOLS, Case, arguments_match

MODES: dict[str, tuple[str, bool | None]] = {
    "unconstrained": ("auto", False),
    "auto": ("auto", None),
    "required": ("required", None),
}
# An answer as the client sees it: content, the calls as (name, arguments text), finish reason, and the
# tokens generated (their bytes, from logprobs), which tell a different generation from a different rendering.
Answer = tuple[str | None, list[tuple[str, str]], str | None, tuple[bytes, ...]]


def wilson(successes: int, trials: int, z: float = 1.96) -> list[float]:
    """The 95% Wilson score interval of a proportion, in percent ([0, 100] when there were no trials)."""
    if trials == 0:
        return [0.0, 100.0]
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return [round(100 * max(0.0, centre - half), 2), round(100 * min(1.0, centre + half), 2)]


def ask(client, model: str, case: Case, mode: str, seed: int, stream: bool, **sampling: Any) -> Answer:
    """One case's answer from the API, streamed or not, folded into (content, calls, finish reason)."""
    tool_choice, strict = MODES[mode]
    kwargs = dict(
        model=model, messages=case.messages, tools=case.openai_tools(strict), tool_choice=tool_choice, seed=seed,
        parallel_tool_calls=False, logprobs=True, **sampling,
    )  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        tokens = tuple(bytes(t.bytes) for t in choice.logprobs.content) if choice.logprobs else ()
        return choice.message.content, calls, choice.finish_reason, tokens
    content, calls, finish, tokens = None, {}, None, []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += [bytes(t.bytes) for t in choice.logprobs.content or ()]
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish, tuple(tokens)


def judge(case: Case, answer: Answer) -> dict[str, bool]:
    """Whether the answer called a tool, whether every call parses and validates against its tool's schema,
    whether its first call is to the expected tool, and whether that call holds the expected arguments."""
    import jsonschema

    _, calls, finish, _ = answer
    valid = bool(calls)
    for name, arguments in calls:
        try:
            parsed = json.loads(arguments)
            jsonschema.validate(parsed, TOOLS[name]["parameters"])
        except (ValueError, KeyError, jsonschema.ValidationError):
            valid = False
        if name not in case.tools:
            valid = False
    right_tool = bool(calls) and calls[0][0] == case.expected_tool
    right_arguments = False
    if right_tool:
        with contextlib.suppress(ValueError):
            right_arguments = arguments_match(case.expected_arguments, json.loads(calls[0][1]))
    return {
        "called": bool(calls),
        "finished": bool(calls) and finish == "tool_calls",  # not cut by max_tokens
        "valid": valid,
        "right_tool": right_tool,
        "right_arguments": right_arguments,
    }


def summarize(judged: list[dict[str, bool]]) -> dict[str, Any]:
    """Shares with 95% intervals: valid over the answers that called a tool (and over those whose calls
    were not cut by max_tokens), the rest over all cases."""
    n = len(judged)
    called = sum(j["called"] for j in judged)
    finished = sum(j["finished"] for j in judged)
    out: dict[str, Any] = {"cases": n, "called": called, "finished": finished}
    shares = (("valid", "called", called), ("valid_finished", "finished", finished), ("right_tool", None, n),
              ("right_arguments", None, n), ("called", None, n))  # fmt: skip
    for key, among, denominator in shares:
        k = sum(j[key.removesuffix("_finished")] and (among is None or j[among]) for j in judged)
        out[f"{key}_pct"] = round(100 * k / denominator, 2) if denominator else None
        out[f"{key}_ci"] = wilson(k, denominator)
    return out


def run_tool_eval(
    api_url: str,
    api_key: str,
    models: dict[str, str],
    modes: list[str],
    concurrency: int = 16,
    max_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    stream_check: bool = False,
    limit: int | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every case of the suite (or its first ``limit``) for each model label and mode; ``stream_check`` sends
    each case streamed too, at the same concurrency, and counts the answers that are the same."""
    from openai import OpenAI

    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}: choose from {sorted(MODES)}")
    client = OpenAI(base_url=f"{api_url.rstrip('/')}/v1", api_key=api_key, max_retries=0, timeout=600)
    cases = CASES[:limit] if limit else CASES
    sampling = {"max_tokens": max_tokens, "temperature": temperature}
    results: dict[str, Any] = {
        "cases": len(cases), "concurrency": concurrency, "max_tokens": max_tokens, "temperature": temperature,
        "seed": seed, "runs": [],
    }  # fmt: skip
    for label, model in models.items():
        for mode in modes:
            runs = [
                (i, stream)
                for stream in ([False, True] if stream_check else [False])
                for i in range(len(cases))
            ]
            start = time.perf_counter()

            def one(run: tuple[int, bool], model=model, mode=mode) -> Answer:
                i, stream = run
                return ask(client, model, cases[i], mode, seed + i, stream, **sampling)

            with ThreadPoolExecutor(concurrency) as pool:
                answers = dict(zip(runs, pool.map(one, runs), strict=True))
            whole = [answers[i, False] for i in range(len(cases))]
            judged = [judge(case, answer) for case, answer in zip(cases, whole, strict=True)]
            row = {"label": label, "model": model, "mode": mode, **summarize(judged)}
            row["finish_reasons"] = {r: sum(a[2] == r for a in whole) for r in {a[2] for a in whole}}
            row["invalid_calls"] = [
                {"case": case.name, "calls": answer[1], "finish_reason": answer[2]}
                for case, answer, j in zip(cases, whole, judged, strict=True)
                if j["called"] and not j["valid"]
            ]
            if stream_check:
                # A pair whose tokens differ was generated differently (the engine's numerics in another
                # batch); a pair with the same tokens and a different answer would be the stream's fault.
                differ = [i for i in range(len(cases)) if answers[i, True] != whole[i]]
                rendered = [cases[i].name for i in differ if answers[i, True][3] == whole[i][3]]
                row["stream_equal"] = len(cases) - len(differ)
                row["stream_differ_generated"] = [
                    cases[i].name for i in differ if answers[i, True][3] != whole[i][3]
                ]
                row["stream_differ_rendered"] = rendered
            row["seconds"] = round(time.perf_counter() - start, 1)
            results["runs"].append(row)
            progress(f"{label} {mode}: {format_row(row)}")
    return results


def format_row(row: dict[str, Any]) -> str:
    def share(key: str) -> str:
        pct, (lo, hi) = row[f"{key}_pct"], row[f"{key}_ci"]
        return "n/a" if pct is None else f"{pct:.1f}% [{lo:.1f}, {hi:.1f}]"

    text = (
        f"called {share('called')}, valid {share('valid')} of {row['called']} calls "
        f"({share('valid_finished')} of {row['finished']} not cut by max_tokens), "
        f"right tool {share('right_tool')}, right arguments {share('right_arguments')}"
    )
    if "stream_equal" in row:
        text += (
            f", stream == non-stream {row['stream_equal']}/{row['cases']} (differing: "
            f"{len(row['stream_differ_generated'])} generated other tokens, "
            f"{len(row['stream_differ_rendered'])} rendered the same tokens otherwise)"
        )
    return text

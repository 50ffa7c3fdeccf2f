"""``tessera bench grammar``: JSON Schema token masks, llguidance against xgrammar, on a real vocabulary.

For each schema: the time from schema to a ready matcher (first, and again for the same schema), the first mask;
then a matcher per row walks a generated conforming document token by token, each step filling the mask and
consuming the document's next token, for one row and for a batch; last, applying masks to float32 logits. The
libraries run in lockstep (step by step, alternating which goes first), so machine load lands on both alike.
Every mask must allow the document's next token: a forbidden one is recorded as a violation.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from tessera.bench.stats import INTERVAL_METHOD, format_interval, mean_interval, quantile, ratio_interval

LIBRARIES = ("llguidance", "xgrammar")
APPLY_VARIANTS = ("llguidance", "xgrammar", "torch")
VOCAB_SIZE = 49152  # SmolLM2's embedding rows; the tokenizer's own vocabulary is as large
EOS = 2  # <|im_end|>, where SmolLM2-Instruct stops

_WORDS = ("alpha", "delta", "Paris", "café", "the", "quick", "brown", "fox", "data", "42nd", "naïve", "zone")


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    """A closed object (structured outputs' strict form); every property required unless ``required``."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


_S, _I, _N, _B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
_ADDRESS = _obj({"street": _S, "city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$", "examples": ["94110", "10001"]}})  # fmt: skip
_TOOLS = [
    _obj(
        {
            "name": {"const": "get_weather"},
            "arguments": _obj(
                {
                    "location": _S,
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                ["location"],
            ),
        }
    ),  # fmt: skip
    _obj(
        {
            "name": {"const": "search_web"},
            "arguments": _obj({"query": _S, "max_results": _I, "safe": _B}, ["query"]),
        }
    ),  # fmt: skip
    _obj(
        {
            "name": {"const": "send_email"},
            "arguments": _obj(
                {
                    "to": {"type": "array", "items": _S, "minItems": 1, "maxItems": 3},
                    "subject": _S,
                    "body": _S,
                }
            ),
        }
    ),  # fmt: skip
]
# Increasing complexity: flat, optional, enums, arrays, nesting, anyOf, $ref, recursion, tool calls.
SCHEMAS: dict[str, dict] = {
    "flat_one_string": _obj({"name": _S}),
    "flat_scalars": _obj({"name": _S, "age": _I, "active": _B, "score": _N}),
    "flat_optional": _obj(
        {"id": _I, "title": _S, "subtitle": _S, "rating": _N, "draft": _B}, ["id", "title"]
    ),
    "enums": _obj(
        {"status": {"enum": ["open", "closed", "pending"]}, "priority": {"enum": [1, 2, 3]}, "label": _S}
    ),
    "const_nullable": _obj({"kind": {"const": "note"}, "text": _S, "due": {"type": ["string", "null"]}}),
    "string_array": _obj({"tags": {"type": "array", "items": _S, "minItems": 1, "maxItems": 6}}),
    "number_array": _obj(
        {"values": {"type": "array", "items": _N, "minItems": 2, "maxItems": 12}, "unit": _S}
    ),
    "pattern_bounds": _obj(
        {
            "code": {
                "type": "string",
                "pattern": "^[A-Z]{3}-[0-9]{4}$",
                "examples": ["ABC-1234", "XYZ-0042"],
            },
            "count": {"type": "integer", "minimum": 0, "maximum": 100},
            "short": {"type": "string", "maxLength": 24},
        }
    ),  # fmt: skip
    "nested_object": _obj({"user": _obj({"name": _S, "email": _S, "address": _ADDRESS})}),
    "deep_nested": _obj({"a": _obj({"b": _obj({"c": _obj({"d": _obj({"value": _I, "note": _S})})})})}),
    "array_of_objects": _obj(
        {
            "items": {
                "type": "array",
                "items": _obj({"sku": _S, "qty": _I, "price": _N}),
                "minItems": 1,
                "maxItems": 5,
            }
        }
    ),  # fmt: skip
    "array_of_nested": _obj(
        {
            "orders": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": _obj(
                    {
                        "id": _I,
                        "customer": _obj({"name": _S, "address": _ADDRESS}),
                        "lines": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": 3,
                            "items": _obj({"sku": _S, "qty": _I}),
                        },
                    }
                ),
            }
        }
    ),  # fmt: skip
    "anyof_scalars": _obj(
        {
            "value": {"anyOf": [_S, _I, _B, {"type": "null"}]},
            "values": {"type": "array", "items": {"anyOf": [_S, _N]}, "maxItems": 6},
        }
    ),  # fmt: skip
    "anyof_objects": _obj(
        {
            "shapes": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "anyOf": [
                        _obj({"kind": {"const": "circle"}, "r": _N}),
                        _obj({"kind": {"const": "rect"}, "w": _N, "h": _N}),
                        _obj({"kind": {"const": "label"}, "text": _S}),
                    ]
                },
            }
        }
    ),  # fmt: skip
    "refs": {
        "$defs": {
            "address": _ADDRESS,
            "person": _obj(
                {"name": _S, "home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
                ["name", "home"],
            ),
        },
        **_obj(
            {
                "owner": {"$ref": "#/$defs/person"},
                "tenants": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 3},
            }
        ),
    },  # fmt: skip
    "recursive_tree": {
        "$defs": {
            "node": _obj(
                {"label": _S, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}}
            )
        },
        "$ref": "#/$defs/node",
    },  # fmt: skip
    "wide_flat_30": _obj(
        {f"field_{i:02d}": (_S, _I, _N, _B, {"enum": ["x", "y", "z"]})[i % 5] for i in range(30)},
        [f"field_{i:02d}" for i in range(0, 30, 2)],
    ),  # fmt: skip
    "tool_call": _TOOLS[0],
    "tool_call_anyof_3": {"anyOf": _TOOLS},
    "chat_completion": _obj(
        {
            "id": _S,
            "created": _I,
            "choices": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": _obj(
                    {
                        "index": _I,
                        "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
                        "message": _obj(
                            {
                                "role": {"const": "assistant"},
                                "content": {"anyOf": [_S, {"type": "null"}]},
                                "tool_calls": {
                                    "type": "array",
                                    "maxItems": 2,
                                    "items": _obj(
                                        {
                                            "id": _S,
                                            "type": {"const": "function"},
                                            "function": {"anyOf": _TOOLS},
                                        }
                                    ),
                                },
                            }
                        ),
                    }
                ),
            },
            "usage": _obj({"prompt_tokens": _I, "completion_tokens": _I, "total_tokens": _I}),
        }
    ),  # fmt: skip
}


def instance(schema: dict, rng: random.Random, root: dict | None = None, depth: int = 0):
    """A value conforming to ``schema`` (the subset SCHEMAS uses): optional properties kept by coin flip,
    arrays sized within their bounds (at their minimum below depth 3, so recursion ends), strings from
    ``examples`` where a pattern constrains them."""
    root = root or schema
    if "$ref" in schema:
        return instance(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], rng, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema or "examples" in schema:
        return rng.choice(schema.get("enum") or schema["examples"])
    if "anyOf" in schema:
        return instance(rng.choice(schema["anyOf"]), rng, root, depth)
    kind = schema["type"]
    kind = rng.choice(kind) if isinstance(kind, list) else kind
    if kind == "object":
        required = set(schema.get("required", ()))
        return {
            key: instance(sub, rng, root, depth + 1)
            for key, sub in schema["properties"].items()
            if key in required or rng.random() < 0.5
        }
    if kind == "array":
        low, high = schema.get("minItems", 0), schema.get("maxItems", 4)
        count = low if depth >= 3 else rng.randint(low, high)
        return [instance(schema["items"], rng, root, depth + 1) for _ in range(count)]
    if kind == "string":
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5)))
        return text[: schema.get("maxLength", len(text))]
    if kind == "integer":
        return rng.randint(schema.get("minimum", 0), schema.get("maximum", 100_000))
    if kind == "number":
        return round(rng.uniform(-1000, 1000), rng.randint(0, 3))
    return {"boolean": rng.random() < 0.5, "null": None}[kind]


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, threads: int) -> None:
        import llguidance
        import llguidance.torch

        self._llg, self._torch = llguidance, llguidance.torch
        started = time.perf_counter()
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB_SIZE, eos_token=[EOS])
        self.setup_s = time.perf_counter() - started
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def matcher(self, schema: dict):
        # No compiled-grammar cache: a matcher is built from the schema for every request.
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self._llg.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"llguidance rejected the schema: {matcher.get_error()}")
        return matcher

    def clear_cache(self) -> None:
        pass

    def fill(self, matchers: list, bitmask) -> None:
        if len(matchers) == 1:
            self._torch.fill_next_token_bitmask(matchers[0], bitmask)
        else:
            self._torch.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)  # fmt: skip

    def consume(self, matchers: list, tokens: list[int]) -> list[bool]:
        if len(matchers) == 1:
            return [matchers[0].consume_token(tokens[0])]
        return self._torch.consume_token_par(self._executor, list(zip(matchers, tokens, strict=True)))

    def reset(self, matcher) -> None:
        matcher.reset()

    def apply(self, logits, bitmask) -> None:
        self._torch.apply_token_bitmask_inplace(logits, bitmask)


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_backend, threads: int) -> None:
        import transformers
        import xgrammar

        self._xgr = xgrammar
        started = time.perf_counter()
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer_backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS])
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.setup_s = time.perf_counter() - started
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def matcher(self, schema: dict):
        return self._xgr.GrammarMatcher(self._compiler.compile_json_schema(json.dumps(schema)))

    def clear_cache(self) -> None:
        self._compiler.clear_cache()

    def fill(self, matchers: list, bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matchers: list, tokens: list[int]) -> list[bool]:
        if len(matchers) == 1:
            return [matchers[0].accept_token(tokens[0])]
        return self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def reset(self, matcher) -> None:
        matcher.reset()

    def apply(self, logits, bitmask) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask)


def apply_torch(logits, bitmask) -> None:
    """The eager torch form: unpack each int32 word's 32 bits (bit j of word i is token 32i+j), fill -inf."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def _allows(bitmask, tokens: list[int]) -> list[bool]:
    import torch

    ids = torch.tensor(tokens)
    words = bitmask[torch.arange(len(tokens)), ids >> 5]
    return [bool(b) for b in ((words >> (ids & 31)) & 1).tolist()]


def _walk(lib, schema: dict, documents: list[list[int]], steps: int, name: str, problems: list, keep: list | None = None) -> dict:  # fmt: skip
    """One matcher per document; each step: fill the rows' masks (timed), check each allows its row's next
    token, consume it (timed). A row that ends its document starts it again on a reset matcher. ``keep``
    collects a copy of every step's masks."""
    import numpy
    import torch

    matchers = [lib.matcher(schema) for _ in documents]
    bitmask = torch.full((len(documents), (VOCAB_SIZE + 31) // 32), -1, dtype=torch.int32)
    positions = [0] * len(documents)
    mask_s, consume_s, allowed = [], [], []
    for step in range(steps):
        tokens = [doc[p] for doc, p in zip(documents, positions, strict=True)]
        started = time.perf_counter()
        lib.fill(matchers, bitmask)
        mask_s.append(time.perf_counter() - started)
        if keep is not None:
            keep.append(bitmask.clone())
        for row, ok in enumerate(_allows(bitmask, tokens)):
            if not ok:
                problems.append({"library": lib.name, "schema": name, "rows": len(documents), "row": row, "step": step, "token": tokens[row], "what": "mask forbids the next token"})  # fmt: skip
        if len(documents) == 1:
            allowed.append(int(numpy.unpackbits(bitmask[0].numpy().view(numpy.uint8)).sum()))
        started = time.perf_counter()
        accepted = lib.consume(matchers, tokens)
        consume_s.append(time.perf_counter() - started)
        for row, ok in enumerate(accepted):
            if not ok:
                problems.append({"library": lib.name, "schema": name, "rows": len(documents), "row": row, "step": step, "token": tokens[row], "what": "matcher rejected the next token"})  # fmt: skip
        for row, doc in enumerate(documents):
            positions[row] += 1
            if positions[row] == len(doc):
                positions[row] = 0
                lib.reset(matchers[row])
    return {
        "mask_us": [s * 1e6 for s in mask_s],
        "consume_us": [s * 1e6 for s in consume_s],
        "allowed": allowed,
    }


def _time_ready(lib, schema: dict) -> tuple[float, float, float]:
    """Milliseconds from schema to a ready matcher (cache cleared), the same again, and the first mask."""
    import torch

    bitmask = torch.full((1, (VOCAB_SIZE + 31) // 32), -1, dtype=torch.int32)
    lib.clear_cache()
    started = time.perf_counter()
    matcher = lib.matcher(schema)
    first = time.perf_counter() - started
    started = time.perf_counter()
    lib.fill([matcher], bitmask)
    first_mask = time.perf_counter() - started
    started = time.perf_counter()
    lib.matcher(schema)
    again = time.perf_counter() - started
    return first * 1e3, again * 1e3, first_mask * 1e3


def run_grammar_bench(
    model: Path,
    schemas: list[str],
    rows: list[int],
    max_steps: int,
    apply_rows: list[int],
    repeat: int,
    threads: int,
    as_json: bool,
) -> dict:
    import torch

    from gpu_workers.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(model).backend
    libs = [_Llguidance(tokenizer.to_str(), threads), _Xgrammar(tokenizer, threads)]
    documents: dict[str, list[list[int]]] = {}
    for index, name in enumerate(schemas):
        # Non-ASCII as UTF-8, as a model writes it: llguidance by default rejects a "\u00ef" escape of a printable
        # character (json_allow_general_unicode_escapes), xgrammar accepts it.
        texts = [
            json.dumps(instance(SCHEMAS[name], random.Random(1000 * index + row)), ensure_ascii=False)
            for row in range(max(rows))
        ]
        documents[name] = [tokenizer.encode(t, add_special_tokens=False).ids + [EOS] for t in texts]
    problems: list[dict] = []
    # runs[name][lib] -> one dict per repeat
    runs: dict[str, dict[str, list[dict]]] = {n: {lib.name: [] for lib in libs} for n in schemas}
    masks_for_apply: list = []  # every step's batch masks, first schema, first repeat, first library
    for r in range(repeat):
        for s, name in enumerate(schemas):
            order = libs if (r + s) % 2 == 0 else libs[::-1]
            result: dict[str, dict] = {lib.name: {"walks": {}} for lib in libs}
            for lib in order:
                ready, again, first_mask = _time_ready(lib, SCHEMAS[name])
                result[lib.name].update(ready_ms=ready, again_ms=again, first_mask_ms=first_mask)
            for n in rows:
                docs = documents[name][:n]
                steps = min(max_steps, max(map(len, docs)))
                for lib in order:
                    keep = masks_for_apply if r == s == 0 and n == max(rows) and lib is order[0] else None
                    result[lib.name]["walks"][n] = _walk(
                        lib, SCHEMAS[name], docs, steps, name, problems, keep
                    )
            for lib in libs:
                runs[name][lib.name].append(result[lib.name])
    report: dict = {
        "model": str(model),
        "vocab_size": VOCAB_SIZE,
        "threads": threads,
        "repeat": repeat,
        "max_steps": max_steps,
        "rows": rows,
        "versions": _versions(),
        "interval_method": INTERVAL_METHOD,
        "ratio": "llguidance time / xgrammar time (above 1: xgrammar faster)",
        "tokenizer_setup_s": {lib.name: round(lib.setup_s, 3) for lib in libs},
        "schemas": {},
        "overall": {},
        "apply_us": _bench_apply(libs, apply_rows, masks_for_apply, repeat),
        "problem_count": len(problems),
        "problems": problems[:20],
    }
    for name in schemas:
        report["schemas"][name] = _schema_report(runs[name], documents[name], rows)
    report["overall"] = _overall(runs, rows)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return report


def _schema_report(runs: dict[str, list[dict]], documents: list[list[int]], rows: list[int]) -> dict:
    ll, xg = runs["llguidance"], runs["xgrammar"]
    entry: dict = {"document_tokens": len(documents[0]), "libraries": {}, "ll_over_xgr": {}}
    for key in ("ready_ms", "again_ms", "first_mask_ms"):
        entry["ll_over_xgr"][key] = ratio_interval([x[key] for x in ll], [x[key] for x in xg])
    for lib, reps in runs.items():
        e: dict = {
            key: mean_interval([x[key] for x in reps]) for key in ("ready_ms", "again_ms", "first_mask_ms")
        }
        allowed = reps[0]["walks"][1]["allowed"] if 1 in rows else []
        e["mean_allowed_tokens"] = round(statistics.fmean(allowed), 1) if allowed else None
        for n in rows:
            walks = [x["walks"][n] for x in reps]
            e[f"rows_{n}"] = {
                "steps": len(walks[0]["mask_us"]),
                "mask_mean_us": mean_interval([statistics.fmean(w["mask_us"]) for w in walks]),
                "mask_p95_us": mean_interval([quantile(w["mask_us"], 0.95) for w in walks]),
                "consume_mean_us": mean_interval([statistics.fmean(w["consume_us"]) for w in walks]),
            }
        entry["libraries"][lib] = e
    for n in rows:
        mean = [[statistics.fmean(x["walks"][n]["mask_us"]) for x in reps] for reps in (ll, xg)]
        p95 = [[quantile(x["walks"][n]["mask_us"], 0.95) for x in reps] for reps in (ll, xg)]
        entry["ll_over_xgr"][f"rows_{n}_mask_mean"] = ratio_interval(*mean)
        entry["ll_over_xgr"][f"rows_{n}_mask_p95"] = ratio_interval(*p95)
    return entry


def _overall(runs: dict, rows: list[int]) -> dict:
    """All schemas pooled per repeat: summed times (compile), and every step's mask time (mean, p95)."""
    repeat = len(next(iter(runs.values()))["llguidance"])
    out: dict = {}
    for lib in LIBRARIES:
        e: dict = {}
        for key in ("ready_ms", "again_ms", "first_mask_ms"):
            e[f"{key}_total"] = mean_interval(
                [sum(runs[s][lib][r][key] for s in runs) for r in range(repeat)]
            )
        for n in rows:
            pooled = [
                [t for s in runs for t in runs[s][lib][r]["walks"][n]["mask_us"]] for r in range(repeat)
            ]
            e[f"rows_{n}_mask_mean_us"] = mean_interval([statistics.fmean(p) for p in pooled])
            e[f"rows_{n}_mask_p95_us"] = mean_interval([quantile(p, 0.95) for p in pooled])
        out[lib] = e
    out["ll_over_xgr"] = {
        key: ratio_interval(out["llguidance"][key]["values"], out["xgrammar"][key]["values"])
        for key in out["llguidance"]
    }
    return out


def _bench_apply(libs: list, apply_rows: list[int], masks: list, repeat: int) -> dict:
    """Microseconds per in-place mask application on [rows, VOCAB_SIZE] float32 logits, cycling through a
    real walk's masks (every step of the first schema's batch); the first call (llguidance's torch.compile)
    timed apart and checked against the eager torch form."""
    import torch

    if not apply_rows:
        return {}
    functions = {lib.name: lib.apply for lib in libs} | {"torch": apply_torch}
    out: dict = {}
    for n in apply_rows:
        bitmasks = [m[torch.arange(n) % m.shape[0]].contiguous() for m in masks]
        logits = torch.randn(n, VOCAB_SIZE, generator=torch.Generator().manual_seed(n))
        reference = logits.clone()
        apply_torch(reference, bitmasks[0])
        first, per_call = {v: None for v in functions}, {v: [] for v in functions}
        for r in range(repeat):
            for variant in APPLY_VARIANTS if r % 2 == 0 else APPLY_VARIANTS[::-1]:
                target = logits.clone()
                started = time.perf_counter()
                functions[variant](target, bitmasks[0])
                if first[variant] is None:
                    first[variant] = time.perf_counter() - started
                    if not torch.equal(target, reference):
                        raise AssertionError(
                            f"{variant}'s mask application differs from the eager torch form"
                        )
                elapsed = 0.0
                for bitmask in bitmasks:
                    target.copy_(logits)
                    started = time.perf_counter()
                    functions[variant](target, bitmask)
                    elapsed += time.perf_counter() - started
                per_call[variant].append(elapsed / len(bitmasks) * 1e6)
        out[str(n)] = {
            v: {"first_call_s": round(first[v], 3), "mean_us": mean_interval(per_call[v])} for v in functions
        } | {
            "ll_over_xgr": ratio_interval(per_call["llguidance"], per_call["xgrammar"]),
            "torch_over_xgr": ratio_interval(per_call["torch"], per_call["xgrammar"]),
        }
    return out


def _versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("llguidance", "xgrammar", "torch")}


def _print(report: dict) -> None:
    print(f"{report['model']}: vocab {report['vocab_size']}, {report['threads']} threads, {report['repeat']} repeats, "
          f"versions {report['versions']}; tokenizer setup {report['tokenizer_setup_s']} s")  # fmt: skip
    print(f"ratios: {report['ratio']}; {report['interval_method']}")
    rows = report["rows"]
    header = f"{'schema':<20}{'tok':>5}  {'ready ms ll / xgr':>24}{'again ms ll / xgr':>24}"
    print(header + "".join(f"{f'mask us x{n} ll / xgr (ratio)':>40}" for n in rows))
    for name, e in report["schemas"].items():
        ll, xg, ratio = e["libraries"]["llguidance"], e["libraries"]["xgrammar"], e["ll_over_xgr"]
        line = f"{name:<20}{e['document_tokens']:>5}  "
        line += f"{_pair(ll['ready_ms'], xg['ready_ms'], '.2f'):>24}{_pair(ll['again_ms'], xg['again_ms'], '.3f'):>24}"
        for n in rows:
            k = f"rows_{n}"
            cell = f"{_pair(ll[k]['mask_mean_us'], xg[k]['mask_mean_us'], '.0f')} ({ratio[f'{k}_mask_mean']['mean']:.2f}x)"  # fmt: skip
            line += f"{cell:>40}"
        print(line)
    print()
    for key, ratio in report["overall"]["ll_over_xgr"].items():
        ll, xg = report["overall"]["llguidance"][key], report["overall"]["xgrammar"][key]
        print(f"all schemas {key:<24} llguidance {format_interval(ll, '.1f'):<26} xgrammar {format_interval(xg, '.1f'):<26} "
              f"ll/xgr {format_interval(ratio, '.2f')}")  # fmt: skip
    for n, e in report["apply_us"].items():
        cells = ", ".join(f"{v} {format_interval(e[v]['mean_us'], '.0f', ' us')} (first {e[v]['first_call_s']} s)" for v in APPLY_VARIANTS)  # fmt: skip
        print(f"apply mask to [{n}, {report['vocab_size']}] float32: {cells}; ll/xgr {format_interval(e['ll_over_xgr'], '.2f')}")  # fmt: skip
    print(
        f"problems (a mask forbidding, or a matcher rejecting, the document's next token): {report['problem_count']}"
    )
    for p in report["problems"][:10]:
        print(f"  {p}")


def _pair(a: dict | None, b: dict | None, fmt: str) -> str:
    return f"{a['mean']:{fmt}} / {b['mean']:{fmt}}" if a and b else "-"

"""Engine behaviour: continuous batching, chunked prefill, preemption, sampling, stops, abort, bad input."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.engine import admission as engine_module
from gpu_workers.engine import detokenizer
from gpu_workers.engine.failures import MAX_CONSECUTIVE_FAILED_STEPS
from gpu_workers.kv.transfer import KVBlock
from tests.model_faults import DEVICE_ERROR, FaultyModel, device_error, wait_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(path, **overrides) -> Engine:
    config = dict(dtype="float32", kv_budget_bytes=4 * 2**20, page_size=4, max_num_batched_tokens=64)
    config.update(overrides)
    return Engine.from_pretrained(path, EngineConfig(**config))


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 120) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def run_staggered(engine: Engine, prompts, params) -> dict[str, list[int]]:
    """Add prompts a few at a time between steps, as requests arrive at a server."""
    pending = list(enumerate(prompts))
    ids = {}
    while pending or engine.has_unfinished():
        for _ in range(3):
            if pending:
                i, prompt = pending.pop(0)
                ids[engine.add_request(prompt, params, request_id=f"r{i}")] = i
        engine.step()
    return ids


@pytest.fixture(scope="module")
def alone_outputs(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    return [engine.generate([p], GREEDY)[0].token_ids for p in mixed_prompts(16)]


def test_greedy_matches_hf_transformers_generate(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    engine = make_engine(tiny_llama_dir)
    for prompt in mixed_prompts(3, seed=1):
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert engine.generate([prompt], GREEDY)[0].token_ids == expected


def test_batch_of_16_with_staggered_arrivals_equals_running_alone(tiny_llama_dir, alone_outputs):
    # A 16-token step budget forces chunked prefill for the long prompts while others decode.
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=16)
    outputs = {}
    engine_events = []

    def record(event):
        engine_events.append(event)
        outputs.setdefault(event.request_id, []).extend(event.token_ids)

    prompts = mixed_prompts(16)
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(prompt, GREEDY, request_id=f"r{i}", on_event=record)
        engine.step()
    assert [outputs[f"r{i}"] for i in range(16)] == alone_outputs
    assert engine.stats()["kv_pages_used"] == 0


def test_preemption_under_a_tiny_kv_budget_keeps_greedy_outputs(tiny_llama_dir, alone_outputs):
    spec_bytes = 2 * 2 * 2 * 16 * 4  # layers * (K,V) * kv_heads * head_dim * fp32 bytes per token
    engine = make_engine(tiny_llama_dir, kv_budget_bytes=96 * spec_bytes)  # 96 tokens for 16 requests
    outputs = engine.generate(mixed_prompts(16), GREEDY)
    assert engine.stats()["preemptions"] > 0
    assert [o.token_ids for o in outputs] == alone_outputs
    assert all(o.finish_reason == "length" for o in outputs)
    assert engine.stats()["kv_pages_used"] == 0


def test_same_seed_gives_same_sample_whatever_the_batch(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=10, ignore_eos=True)
    prompt = mixed_prompts(1, seed=3)[0]
    alone = engine.generate([prompt], params)[0].token_ids
    in_batch = engine.generate(mixed_prompts(5) + [prompt], [GREEDY] * 5 + [params])[-1].token_ids
    other_seed = SamplingParams(temperature=1.0, seed=8, max_tokens=10, ignore_eos=True)
    assert alone == in_batch
    assert engine.generate([prompt], other_seed)[0].token_ids != alone


def test_top_k_one_is_greedy(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = mixed_prompts(1, seed=4)[0]
    greedy = engine.generate([prompt], GREEDY)[0].token_ids
    sampled = engine.generate(
        [prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True)
    )
    assert sampled[0].token_ids == greedy


def test_max_tokens_and_stop_token_ids(tiny_llama_dir, alone_outputs):
    engine = make_engine(tiny_llama_dir)
    prompt = mixed_prompts(16)[0]
    expected = alone_outputs[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == expected[:5] and out.finish_reason == "length"
    stop_at = expected[6]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == expected[: expected.index(stop_at) + 1]


def test_eos_stops_unless_ignored(tiny_llama_dir, alone_outputs):
    prompt = mixed_prompts(16)[0]
    expected = alone_outputs[0]
    engine = make_engine(tiny_llama_dir)
    engine.eos_token_ids = frozenset({expected[3]})
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.finish_reason == "stop" and out.token_ids == expected[: expected.index(expected[3]) + 1]


def test_abort_frees_pages_at_once_and_others_continue(tiny_llama_dir, alone_outputs):
    engine = make_engine(tiny_llama_dir)
    prompts = mixed_prompts(16)
    engine.add_request(prompts[0], GREEDY, request_id="keep")
    engine.add_request(prompts[1], GREEDY, request_id="drop")
    finished = {}
    for _ in range(3):
        engine.step()
    used_before = engine.stats()["kv_pages_used"]
    assert engine.abort("drop")
    assert engine.stats()["kv_pages_used"] < used_before
    assert not engine.abort("drop")
    while engine.has_unfinished():
        for event in engine.step():
            finished[event.request_id] = event.finish_reason
    assert engine.stats()["kv_pages_used"] == 0
    assert "drop" not in finished


def test_abort_reports_abort_reason(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    events = []
    engine.add_request(mixed_prompts(1)[0], GREEDY, request_id="x", on_event=events.append)
    engine.step()
    engine.abort("x")
    assert events[-1].finish_reason == "abort"
    assert engine.stats()["running"] == 0 and engine.stats()["kv_pages_used"] == 0


def test_closing_a_stream_early_aborts_the_request(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    stream = engine.stream(mixed_prompts(1)[0], GREEDY)
    next(stream)
    stream.close()
    assert engine.stats()["kv_pages_used"] == 0 and not engine.has_unfinished()


def test_stream_yields_the_same_tokens_as_generate(tiny_llama_dir, alone_outputs):
    engine = make_engine(tiny_llama_dir)
    events = list(engine.stream(mixed_prompts(16)[0], GREEDY))
    assert [t for e in events for t in e.token_ids] == alone_outputs[0]
    assert events[-1].finish_reason == "length"


def test_background_loop_serves_concurrent_streams(tiny_llama_dir, alone_outputs):
    import concurrent.futures

    engine = make_engine(tiny_llama_dir)
    engine.start()
    try:
        prompts = mixed_prompts(16)[:6]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(
                pool.map(lambda p: [t for e in engine.stream(p, GREEDY) for t in e.token_ids], prompts)
            )
    finally:
        engine.stop()
    assert results == alone_outputs[:6]


@pytest.mark.parametrize(
    "prompt, params, code",
    [
        ([], GREEDY, "empty_prompt"),
        ([5] * 300, GREEDY, "context_length_exceeded"),
        ([5] * 10, SamplingParams(max_tokens=250), "context_length_exceeded"),
        ([5] * 10, SamplingParams(max_tokens=0), "invalid_max_tokens"),
        ([5] * 10, SamplingParams(max_tokens=-3), "invalid_max_tokens"),
        ([5] * 10, SamplingParams(top_p=0.0), "invalid_top_p"),
        ([5] * 10, SamplingParams(top_p=1.5), "invalid_top_p"),
        ([5] * 10, SamplingParams(temperature=-1), "invalid_temperature"),
        ([5, 999], GREEDY, "invalid_prompt"),
        ("text without a tokenizer", GREEDY, "no_tokenizer"),
    ],
)
def test_bad_requests_fail_cleanly_and_the_engine_keeps_serving(
    tiny_llama_dir, alone_outputs, prompt, params, code
):
    engine = make_engine(tiny_llama_dir)
    bad, good = engine.generate([prompt, mixed_prompts(16)[0]], [params, GREEDY])
    assert bad.finish_reason == "error" and bad.error.code == code and bad.error.message
    assert good.token_ids == alone_outputs[0]


def test_request_larger_than_the_whole_kv_budget_is_rejected_not_looped(tiny_llama_dir):
    token_bytes = 2 * 2 * 2 * 16 * 4
    engine = make_engine(tiny_llama_dir, kv_budget_bytes=32 * token_bytes)
    assert engine.stats()["kv_capacity_tokens"] == 32
    out = engine.generate([[5] * 30], SamplingParams(max_tokens=10))[0]
    assert out.finish_reason == "error" and out.error.code == "kv_budget_exceeded"
    assert "32" in out.error.message
    out = engine.generate([[5] * 40], SamplingParams(max_tokens=1))[0]
    assert out.error.code == "kv_budget_exceeded"
    assert not engine.has_unfinished()


def test_budget_that_holds_no_page_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        make_engine(tiny_llama_dir, kv_budget_bytes=100)


def test_fcfs_admission_with_one_slot(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1)
    order = []
    for i, prompt in enumerate(mixed_prompts(4)):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}")
    while engine.has_unfinished():
        order += [e.request_id for e in engine.step() if e.finish_reason]
    assert order == ["r0", "r1", "r2", "r3"]


def test_stop_strings_truncate_text_and_stream_matches(demo_model_dir):
    engine = Engine.from_pretrained(demo_model_dir, EngineConfig(dtype="float32", page_size=4))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = engine.generate(["def main():"], params)[0].text
    assert len(full) > 6
    stop = full[3:6]
    stopped = engine.generate(["def main():"], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]
    streamed = "".join(
        e.text
        for e in engine.stream("def main():", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    )
    assert streamed == stopped.text
    assert "\ufffd" not in streamed


# -- failures: a failed step ends only its requests; an engine that cannot go on says so --------------------


def run_in_background(engine: Engine, requests: list[tuple[str, object, dict]], timeout_s: float = 60.0):
    """Serve ``(request_id, prompt, add_request kwargs)`` on the engine's own loop; returns each request's
    events. Fails (instead of hanging) if they do not all finish."""
    events: dict[str, list] = {rid: [] for rid, _, _ in requests}
    done = threading.Semaphore(0)

    def record(event):
        events[event.request_id].append(event)
        if event.finish_reason is not None:
            done.release()

    engine.start()
    try:
        for rid, prompt, kwargs in requests:
            engine.add_request(
                prompt, kwargs.pop("params", GREEDY), request_id=rid, on_event=record, **kwargs
            )
        for _ in requests:
            assert done.acquire(timeout=timeout_s), f"not every request finished: {events}"
    finally:
        engine.stop()
    return events


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_a_kv_block_the_engine_cannot_import_fails_only_its_request(tiny_llama_dir, alone_outputs):
    prompts = mixed_prompts(16)
    prefill = make_engine(tiny_llama_dir)
    exported = []
    prefill.add_request(
        prompts[5], SamplingParams(max_tokens=1), export_kv="fp8_e4m3", on_event=exported.append
    )
    while prefill.has_unfinished():
        prefill.step()
    block = exported[-1].kv
    no_scales = KVBlock("fp8_e4m3", block.num_tokens, block.k, block.v)  # FP8 bits, but no scales
    engine = make_engine(tiny_llama_dir, kv_cache_dtype="fp8_e4m3")
    requests = [(f"r{i}", prompts[i], {}) for i in range(3)]
    requests.append(("broken", prompts[5] + exported[-1].token_ids, {"kv_import": no_scales}))
    requests += [(f"r{i}", prompts[i], {}) for i in range(3, 6)]
    events = run_in_background(engine, requests)
    broken = events.pop("broken")[-1]
    assert broken.finish_reason == "error" and broken.error.code == "invalid_kv_import"
    assert "k_scale" in broken.error.message
    fp8_alone = make_engine(tiny_llama_dir, kv_cache_dtype="fp8_e4m3")
    for rid, evs in events.items():
        assert evs[-1].finish_reason == "length"
        assert tokens(evs) == fp8_alone.generate([prompts[int(rid[1:])]], GREEDY)[0].token_ids
    assert engine.stats()["kv_pages_used"] == 0


class FailingDetokenizer(detokenizer.IncrementalDetokenizer):
    """The engine's detokeniser, except that one token id raises, as a broken vocabulary entry would."""

    poison: int

    def push(self, token_ids):
        if self.poison in token_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, f"token {self.poison} maps to invalid bytes")
        return super().push(token_ids)


def test_an_exception_anywhere_in_a_step_fails_only_the_requests_in_it(demo_model_dir, caplog, monkeypatch):
    healthy = Engine.from_pretrained(
        demo_model_dir, EngineConfig(dtype="float32", page_size=4, max_num_seqs=2)
    )
    texts = {"a": "def main():", "b": "x = 1", "c": "return None", "d": "import os"}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = {k: healthy.generate(t, params)[0] for k, t in texts.items()}
    poison = alone["a"].token_ids[2]  # "a" streams two tokens, then its third fails the step
    for k in "bcd":
        assert poison not in alone[k].token_ids + healthy.tokenizer.encode(texts[k])
    monkeypatch.setattr(FailingDetokenizer, "poison", poison, raising=False)
    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", FailingDetokenizer)
    engine = Engine(healthy.model, healthy.tokenizer, healthy.config)
    # Two slots: "a" and "b" share steps; "c" waits for a slot, so it is in no step that fails.
    requests = [(k, texts[k], {"params": params}) for k in "abc"]
    events = run_in_background(engine, requests)
    for k in "ab":
        final = events[k][-1]
        assert final.finish_reason == "error" and final.error.code == "internal_error"
        assert (
            "UnicodeDecodeError" in final.error.message and "other requests continue" in final.error.message
        )
    assert tokens(events["a"]) == alone["a"].token_ids[:2]
    assert tokens(events["c"]) == alone["c"].token_ids and events["c"][-1].finish_reason == "length"
    assert any(r.exc_info and r.exc_info[0] is UnicodeDecodeError for r in caplog.records)  # the traceback
    assert engine.failed is None and engine.stats()["kv_pages_used"] == 0
    assert engine.generate(texts["d"], params)[0].token_ids == alone["d"].token_ids  # it goes on serving


def faulty_engine(tiny_llama_dir, trigger: int, fault, **flags) -> Engine:
    healthy = make_engine(tiny_llama_dir)
    return Engine(FaultyModel(healthy.model, trigger, fault, **flags), None, healthy.config)


def test_a_device_error_stops_the_engine_and_ends_every_request(tiny_llama_dir):
    prompts = mixed_prompts(16)
    trigger = 121  # mixed_prompts draws ids below 120: only the request that carries it trips the fault
    engine = faulty_engine(tiny_llama_dir, trigger, device_error, sticky=True)
    failures = []
    engine.add_request(prompts[0], SamplingParams(max_tokens=200, ignore_eos=True), request_id="running")
    engine.step()
    engine.start(on_failure=failures.append)
    events = []
    try:
        engine.add_request(prompts[1] + [trigger], GREEDY, request_id="trigger", on_event=events.append)
        # Not yet admitted when the engine fails (one slot): it never ran, and still ends.
        engine.add_request(prompts[2], GREEDY, request_id="queued", on_event=events.append)
        end = time.monotonic() + 30
        while engine.failed is None or engine.has_unfinished():
            assert time.monotonic() < end, "the engine neither failed nor finished"
            time.sleep(0.01)
    finally:
        engine.stop()
    assert str(engine.failed) == DEVICE_ERROR and failures == [engine.failed]
    final = {e.request_id: e for e in events if e.finish_reason}
    assert set(final) == {"trigger", "queued"}
    assert all(
        e.error.code == "engine_failed" and "illegal memory access" in e.error.message for e in final.values()
    )
    assert engine.stats()["kv_pages_used"] == 0 and engine.stats()["failed"]
    late = engine.generate([prompts[3]], GREEDY)[0]
    assert late.finish_reason == "error" and late.error.code == "engine_failed"


def test_steps_that_keep_failing_stop_the_engine(tiny_llama_dir):
    prompts = mixed_prompts(16)
    trigger = 121

    def broken():
        raise ValueError("layer 0 returned a tensor of the wrong shape")

    engine = faulty_engine(tiny_llama_dir, trigger, broken, sticky=True)  # every step fails from now on
    first = engine.generate([prompts[0] + [trigger]], GREEDY)[0]
    assert first.error.code == "internal_error" and engine.failed is None  # one failed step: it goes on
    later = [engine.generate([p], GREEDY)[0] for p in prompts[1:3]]
    assert [o.error.code for o in later] == ["internal_error", "engine_failed"]
    assert isinstance(engine.failed, ValueError)
    assert engine.stats()["failed_steps"] == MAX_CONSECUTIVE_FAILED_STEPS


def test_stats_never_wait_for_a_running_step(tiny_llama_dir):
    trigger, release = 121, threading.Event()
    engine = faulty_engine(tiny_llama_dir, trigger, wait_for(release), once=True)
    engine.start()
    try:
        engine.add_request(mixed_prompts(1)[0] + [trigger], GREEDY, request_id="slow")
        assert engine.model.tripped.wait(30)  # the step is inside the model's forward, holding the lock
        read = threading.Thread(target=lambda: reads.append(engine.stats()))
        reads: list[dict] = []
        read.start()
        read.join(timeout=10)  # a bound for a broken build, which would block here until the release
        assert reads and reads[0]["running"] == 1
    finally:
        release.set()
        engine.stop()


def test_text_the_tokenizer_cannot_encode_finishes_with_an_error_instead_of_raising(demo_model_dir):
    from gpu_workers import Engine, EngineConfig

    engine = Engine.from_pretrained(demo_model_dir, EngineConfig(kv_budget_bytes=1 << 20))
    (out,) = engine.generate("def f(\ud800):")
    assert out.finish_reason == "error"
    assert out.error.code == "invalid_prompt"
    assert "U+D800" in out.error.message and "character 6" in out.error.message


@pytest.mark.parametrize(("kv", "max_tokens"), [("fp8_e4m3", 3), ("auto", 3), ("fp8_e4m3", 1)])
def test_warm_up_runs_the_decode_kernels_and_leaves_no_trace(tiny_llama_dir, monkeypatch, kv, max_tokens):
    """A worker's warm-up request reaches the CPU decode kernel (when it decodes) and leaves the engine as
    it was: counters, prefix-cache statistics and free pages unchanged, and the same greedy tokens after."""
    import gpu_workers.kernels.decode_step_cpu as cpu

    calls = []
    kernel = cpu.rotate_write_and_decode_cpu
    monkeypatch.setattr(cpu, "rotate_write_and_decode_cpu", lambda *a: calls.append(1) or kernel(*a))
    engine = make_engine(tiny_llama_dir, kv_cache_dtype=kv)
    before = engine.stats()
    assert engine.warm_up(max_tokens=max_tokens) > 0
    after = engine.stats()
    for key in (
        "steps",
        "generated_tokens",
        "computed_tokens",
        "prefix_cache_query_tokens",
        "prefix_cache_hit_tokens",
    ):
        assert after[key] == before[key], key
    assert after["running"] == after["waiting"] == 0
    assert engine.pages.num_free == engine.pages.num_pages  # cached prefix pages count as free
    layers = engine.model.config.num_layers
    assert len(calls) == (max_tokens - 1) * layers  # every decode step, every layer; none for prefill only
    prompts = mixed_prompts(8, seed=3)
    cold = make_engine(tiny_llama_dir, kv_cache_dtype=kv).generate(prompts, GREEDY)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [o.token_ids for o in cold]

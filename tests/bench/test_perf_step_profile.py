"""tools/perf/step_profile.py on the CPU: each mode's step profile from a real engine (a synthetic
model), and a JSON bench/report.py renders (date, device, commit, command, a row per mode)."""

from __future__ import annotations

import json

from bench_util import load_bench, load_perf
from serve_util import library_or_skip, make_served_model

step_profile = load_perf("step_profile")
report = load_bench("report")


def profile(tmp_path, output: int, modes: str) -> tuple[dict, str]:
    """step_profile.py on a synthetic served model, 3 requests of 6 prompt tokens: its JSON and
    the file's name."""
    library_or_skip()
    model = make_served_model(tmp_path / "model")
    out = tmp_path / "step-profile-cpu.json"
    args = [str(model), "--batch", "3", "--prompt", "6", "--output", str(output), "--capacity",
            "64", "--modes", modes, "--json", str(out)]  # fmt: skip
    assert step_profile.main(args) == 0
    return json.loads(out.read_text()), out.name


def test_each_mode_profiles_its_graph_and_the_json_renders(tmp_path):
    data, name = profile(tmp_path, output=4, modes="device,packed,host")
    assert {"date", "device", "commit", "command"} <= set(data)
    assert data["command"].startswith("python tools/perf/step_profile.py ")
    modes = {r["mode"]: r for r in data["results"]}
    assert set(modes) == {"device", "packed", "host"}
    assert modes["packed"]["packed"] and not modes["device"]["packed"]
    assert not modes["host"]["sample_on_device"]
    for r in modes.values():
        assert r["steps"] > 0 and r["phase_ms_per_step"]["run"] > 0
        assert "gpu_ms_per_step" not in r  # no CUDA here: no GPU column to claim
    # packed: the three prompts of the first step in one call
    assert modes["packed"]["prefill_calls"] < modes["device"]["prefill_calls"]
    block = "\n".join(report.step_profile(data, name))
    for label in ("served (device sampling)", "served, packed", "model's own (host)"):
        assert f"| {label} |" in block


def test_steps_split_by_kind(tmp_path):
    """by_kind: the steps that ran a prefill call and those that decoded alone, which add up to
    the run's steps; their rows render under the mode's."""
    data, name = profile(tmp_path, output=5, modes="device")
    (r,) = data["results"]
    kinds = r["by_kind"]
    assert set(kinds) == {"decode", "prefill"}
    # one prefill call a prompt (a call per chunk), the rest decode steps
    assert kinds["prefill"]["steps"] >= 1 and kinds["decode"]["steps"] >= 4 - 1
    assert kinds["decode"]["steps"] + kinds["prefill"]["steps"] == r["steps"]
    assert kinds["decode"]["phase_ms_per_step"]["run"] > 0
    assert "gpu_ms_per_step" not in kinds["decode"]  # no CUDA here
    block = "\n".join(report.step_profile(data, name))
    assert "| served (device sampling): decode steps |" in block
    assert "| served (device sampling): prefill steps |" in block


class _FakeProfiler:
    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")


def test_the_decode_profiler_covers_the_steps_where_every_request_decodes(tmp_path):
    """StepKinds with a profiler (the GPU pass's, faked here): started once, at the first step
    where the whole burst decodes, stopped once after the step that ends it."""
    library_or_skip()
    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    model = make_served_model(tmp_path / "model")
    with Engine(model, EngineConfig(max_batch=3, capacity=64, sample_on_device=True)) as engine:
        params = RequestParams(max_tokens=5, ignore_eos=True)
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
        fake = _FakeProfiler()
        kinds = step_profile.StepKinds(engine, fake)
        step_profile.wrapped_burst(engine, prompts, [params] * len(prompts), kinds)
    assert fake.calls == ["start", "stop"]
    # every prompt prefilled (their first token) before the profiler starts, then 4 decode
    # steps: the last request to be prefilled decodes its other 4 tokens in steps of decode
    # rows alone, all profiled (earlier requests may decode beside its prefill call)
    assert kinds.steps["prefill"] >= 1
    assert kinds.profiled_steps == 4 <= kinds.steps["decode"]
    assert engine._step is not kinds  # unwrapped


def test_driver_calls_are_counted_per_pass_and_rendered():
    """driver_delta keeps the calls made between two readings; a result's `driver` renders as
    one line under the table (CPU builds have none: the key is absent)."""
    before = {"cuMemCreate": {"calls": 2, "ns": 100}, "cuMemUnmap": {"calls": 1, "ns": 50}}
    after = {"cuMemCreate": {"calls": 34, "ns": 3300}, "cuMemUnmap": {"calls": 1, "ns": 50}}
    assert step_profile.driver_delta(before, after) == {"cuMemCreate": {"calls": 32, "ns": 3200}}
    assert step_profile.driver_delta({}, after)["cuMemUnmap"] == {"calls": 1, "ns": 50}
    result = {"mode": "packed", "overlap": True, "sample_on_device": True, "steps": 4,
              "wall_ms_per_step": 2.0, "phase_ms_per_step": {"kv": 0.5}, "output_tok_s": 10.0,
              "driver": {"cuMemCreate": {"calls": 32, "ns": 3200, "us_per_call": 0.1,
                                         "ms_per_step": 0.0008}}}  # fmt: skip
    data = {"date": "d", "device": "cpu", "commit": "c", "command": "python x", "results": [result]}
    block = "\n".join(report.step_profile(data, "step-profile-x.json"))
    assert "The KV cache's CUDA driver calls, served, packed: cuMemCreate 32 x 0 us" in block


def test_more_requests_than_slots_turn_the_slots_over(tmp_path):
    """--requests above the slots, lengths drawn from ranges: every request runs (its output
    tokens count), the kinds get wall times, and no decode-only GPU pass is claimed."""
    library_or_skip()
    model = make_served_model(tmp_path / "model")
    out = tmp_path / "step-profile-cpu.json"
    args = [str(model), "--batch", "2", "--requests", "5", "--prompt", "3:6", "--output",
            "2:4", "--capacity", "64", "--modes", "packed", "--json", str(out)]  # fmt: skip
    assert step_profile.main(args) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["requests"] == 5
    assert r["by_kind"]["prefill"]["steps"] >= 3  # five prompts through two slots
    assert sum(k["steps"] for k in r["by_kind"].values()) == r["steps"]
    assert "gpu_ms_per_step" not in r["by_kind"]["decode"]


def test_length_ranges_are_checked():
    assert step_profile.length_range("7") == (7, 7)
    assert step_profile.length_range("64:512") == (64, 512)
    for bad in ("0", "5:4", "x"):
        try:
            step_profile.length_range(bad)
        except (step_profile.argparse.ArgumentTypeError, ValueError):
            continue
        raise AssertionError(f"{bad!r} accepted")


class _Event:
    def __init__(self, key: str, count: int, us: float):
        self.key, self.count, self.self_device_time_total = key, count, us


class _KernelProfile:
    def key_averages(self):
        return [_Event("gemm", 64, 4000.0), _Event("gather", 128, 300.0), _Event("memcpy", 4, 0.0),
                _Event("gqa_decode", 64, 1200.0)]  # fmt: skip


def test_top_kernels_are_per_step_and_rendered():
    """top_kernels: the kernels of most GPU time, per step (us and launches), none without
    time; kernel_table prints each pass's."""
    top = step_profile.top_kernels(_KernelProfile(), steps=4, n=2)
    assert top == [
        {"name": "gemm", "us_per_step": 1000.0, "launches_per_step": 16.0},
        {"name": "gqa_decode", "us_per_step": 300.0, "launches_per_step": 16.0},
    ]
    result = {"mode": "packed", "overlap": True, "gpu_kernels": top,
              "by_kind": {"decode": {"gpu_kernels": top[:1]}}}  # fmt: skip
    lines = step_profile.kernel_table([result])
    assert "GPU kernels per step, packed (overlap on), all steps:" in lines
    assert "GPU kernels per step, packed (overlap on), decode-only steps:" in lines
    assert "| gemm | 1000.0 | 16.0 |" in lines
    assert step_profile.kernel_table([{"mode": "packed"}]) == []


def test_an_emulated_device_gives_run_busy_and_the_pipeline_counts_steps(tmp_path):
    """--device-ms: each Run also holds an emulated device (a sleep), whose busy time gives the
    host share; --pipeline on,off: a pipelined run of decode steps counts as its steps in
    by_kind (the kinds add up to the run's steps either way); the table names the column."""
    library_or_skip()
    model = make_served_model(tmp_path / "model")
    out = tmp_path / "step-profile-cpu.json"
    args = [str(model), "--batch", "3", "--prompt", "6", "--output", "8", "--capacity", "64",
            "--modes", "packed", "--decode-buckets", "1,2,3", "--device-ms", "2", "--threads",
            "1", "--pipeline", "off,on", "--json", str(out)]  # fmt: skip
    assert step_profile.main(args) == 0
    data = json.loads(out.read_text())
    off, on = data["results"]
    assert (off["pipeline"], on["pipeline"]) == (False, True) and on["ort_threads"] == 1
    for r in (off, on):
        assert r["device_ms"] == 2 and r["run_busy_ms_per_step"] >= 2.0
        assert 0 <= r["host_share"] < 1
        kinds = r["by_kind"]
        assert sum(k["steps"] for k in kinds.values()) == r["steps"]
    assert on["steps"] == off["steps"]  # the same steps, pipelined or not
    block = "\n".join(report.step_profile(data, out.name))
    assert "Run busy ms/step" in block and "emulated device 2 ms" in block
    assert "| served, packed, pipeline on |" in block


def test_switch_intervals_run_a_pass_each_named_and_restored(tmp_path):
    import sys

    library_or_skip()
    model = make_served_model(tmp_path / "model")
    out = tmp_path / "step-profile-cpu.json"
    before = sys.getswitchinterval()
    args = [str(model), "--batch", "2", "--prompt", "4", "--output", "3", "--capacity", "64",
            "--modes", "packed", "--switch-interval", "5,0.5", "--json", str(out)]  # fmt: skip
    assert step_profile.main(args) == 0
    assert sys.getswitchinterval() == before  # the process's own setting back
    data = json.loads(out.read_text())
    assert [r["switch_interval_ms"] for r in data["results"]] == [5.0, 0.5]
    block = "\n".join(report.step_profile(data, out.name))
    assert "(GIL switch interval 0.5 ms)" in block and "(GIL switch interval 5 ms)" in block
    for bad in ("0", "x", "-1"):
        try:
            step_profile.main([str(model), "--switch-interval", bad])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"--switch-interval {bad} was accepted")


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Device:
    def __init__(self, name):
        self.name = name


class _TimedEvent:
    def __init__(self, name, start, end, device="CPU"):
        self.name, self.time_range, self.device_type = name, _Range(start, end), _Device(device)


class _RangeProfile:
    """A profiler's events: host ranges (CPU) and kernels (CUDA), in us."""

    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_kernels_are_split_by_the_range_they_start_in():
    """gpu_split: each kernel's time goes to the range of the prefix that it starts in (ms, with
    the ranges counted); a kernel outside them (or in another prefix's range) to "other"."""
    prof = _RangeProfile([
        _TimedEvent("kvl_call:bucket", 0, 100), _TimedEvent("gemm", 10, 60, "CUDA"),
        _TimedEvent("attn", 60, 90, "CUDA"),
        _TimedEvent("kvl_call:packed", 200, 500), _TimedEvent("gemm", 210, 400, "CUDA"),
        _TimedEvent("kvl_call:bucket", 600, 700), _TimedEvent("gemm", 610, 650, "CUDA"),
        _TimedEvent("other_range", 800, 900), _TimedEvent("memset", 810, 820, "CUDA"),
        _TimedEvent("late", 520, 530, "CUDA"),
    ])  # fmt: skip
    split = step_profile.gpu_split(prof, "kvl_call:")
    assert split == {"bucket": (0.12, 2), "packed": (0.19, 1), "other": (0.02, 0)}


def test_calls_and_steps_get_ranges_and_each_call_kind_its_host_time(tmp_path, monkeypatch):
    """CallTimes times each executor call by kind and, with ranges, opens a profiler range per
    call; StepRanges one per step, its kind noted in order; both restore what they wrap."""
    library_or_skip()
    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    opened = []

    class _Recorded:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            opened.append(self.name)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(step_profile, "record_range", _Recorded)
    model = make_served_model(tmp_path / "model")
    config = EngineConfig(max_batch=3, capacity=64, sample_on_device=True, packed=True,
                          decode_buckets=(1, 2, 4))  # fmt: skip
    with Engine(model, config) as engine:
        calls = step_profile.CallTimes(engine.executor, ranges=True)
        ranges = step_profile.StepRanges(engine)
        engine._step = ranges
        params = RequestParams(max_tokens=4, ignore_eos=True)
        step_profile.burst(engine, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [params] * 3)
        engine._step = ranges.step
        calls.close()
        assert "run_packed" not in vars(engine.executor)  # the class's method again
        stats = engine.stats()
    summary = calls.summary()
    assert summary["packed"]["calls"] >= 1 and summary["bucket"]["calls"] >= 3
    assert all(row["wall_ms_per_call"] > 0 for row in summary.values())
    assert opened.count("kvl_call:packed") == summary["packed"]["calls"]
    assert opened.count("kvl_call:bucket") == summary["bucket"]["calls"]
    steps = [name for name in opened if name.startswith("kvl_step:")]
    assert steps == [f"kvl_step:{i}" for i in range(len(ranges.kinds))]
    assert ranges.kinds[0] == "prefill" and ranges.kinds[-1] == "decode"
    assert sum(ranges.steps.values()) == stats["steps"]


def test_the_calls_render_as_a_table_with_their_host_time_beyond_the_gpu():
    """A result's `calls` render under the step table (host ms, GPU ms, the difference); without
    GPU times the GPU columns are dashes."""
    result = {"mode": "packed", "overlap": True, "sample_on_device": True, "steps": 4,
              "wall_ms_per_step": 2.0, "phase_ms_per_step": {"run": 1.5}, "output_tok_s": 10.0,
              "calls": {"bucket": {"calls": 3, "wall_ms_per_call": 1.9, "gpu_ms_per_call": 1.8,
                                   "host_ms_per_call": 0.1},
                        "packed": {"calls": 1, "wall_ms_per_call": 6.0}}}  # fmt: skip
    data = {"date": "d", "device": "cpu", "commit": "c", "command": "python x", "results": [result]}
    block = "\n".join(report.step_profile(data, "step-profile-x.json"))
    assert "| bucket | 3 | 1.90 | 1.80 | 0.10 |" in block
    assert "| packed | 1 | 6.00 | - | - |" in block
    assert "A call's host ms" in block


def test_the_step_ranges_start_the_profiler_on_the_engine_thread_and_stop_it_when_idle(tmp_path):
    """StepRanges with a profiler (faked): started in the first step, on the engine thread (torch
    records the ranges of the thread that started it), and stopped there after the step that
    leaves the engine idle once the whole burst was submitted."""
    library_or_skip()
    import threading

    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    class Threaded(_FakeProfiler):
        def start(self):
            super().start()
            self.thread = threading.current_thread()

    model = make_served_model(tmp_path / "model")
    with Engine(model, EngineConfig(max_batch=2, capacity=64, sample_on_device=True)) as engine:
        fake = Threaded()
        ranges = step_profile.StepRanges(engine, fake)
        engine._step = ranges
        params = RequestParams(max_tokens=3, ignore_eos=True)
        step_profile.burst(engine, [[5, 6], [7, 8, 9], [10]], [params] * 3,
                           submitted=lambda: setattr(ranges, "armed", True))  # fmt: skip
        assert ranges.stopped.wait(10)
        engine._step = ranges.step
    assert fake.calls == ["start", "stop"]
    assert fake.thread is not threading.main_thread()


def test_graph_chunks_run_a_pass_each_labelled_and_their_calls_are_timed(tmp_path):
    """--graph-chunk 0,4: a pass with eager packed prefill calls and one whose prefill steps run
    as calls of fixed shapes (EngineConfig.graph_chunk), each labelled; the second's prefill
    calls are timed as `graphed`."""
    library_or_skip()
    model = make_served_model(tmp_path / "model")
    out = tmp_path / "step-profile-cpu.json"
    args = [str(model), "--batch", "3", "--prompt", "6", "--output", "4", "--capacity", "64",
            "--modes", "packed", "--decode-buckets", "1,2,4", "--graph-chunk", "0,4",
            "--json", str(out)]  # fmt: skip
    assert step_profile.main(args) == 0
    eager, graphed = json.loads(out.read_text())["results"]
    assert (eager["label"], graphed["label"]) == ("eager prefill", "graph chunk 4")
    assert (eager["graph_chunk"], graphed["graph_chunk"]) == (0, 4)
    assert "packed" in eager["calls"] and "graphed" not in eager["calls"]
    assert graphed["calls"]["graphed"]["calls"] >= 2 and "packed" not in graphed["calls"]


def test_device_ids_run_a_pass_each_labelled(tmp_path):
    """--device-ids off,on: the pipelined decode with ids from the host, then from the last
    call's tokens on the device (EngineConfig.device_ids), each pass labelled."""
    library_or_skip()
    model = make_served_model(tmp_path / "model")
    out = tmp_path / "step-profile-cpu.json"
    args = [str(model), "--batch", "3", "--prompt", "6", "--output", "6", "--capacity", "64",
            "--modes", "packed", "--decode-buckets", "1,2,4", "--pipeline", "on",
            "--device-ids", "off,on", "--json", str(out)]  # fmt: skip
    assert step_profile.main(args) == 0
    host, fed = json.loads(out.read_text())["results"]
    assert (host["label"], fed["label"]) == ("ids from the host", "ids on the device")
    assert (host["device_ids"], fed["device_ids"]) == (False, True)
    assert fed["steps"] > 0 and fed["calls"]["bucket"]["calls"] >= 4


def test_each_packed_call_is_timed_once_prepared_ahead_or_not(tmp_path):
    """Pipelined with more requests than slots, some prefill calls are prepared during the last
    decode call and run later (run_prepared): each packed call, prepared or not, is one call."""
    library_or_skip()
    model = make_served_model(tmp_path / "model")
    out = tmp_path / "step-profile-cpu.json"
    args = [str(model), "--batch", "2", "--requests", "6", "--prompt", "4:8", "--output", "3:6",
            "--capacity", "64", "--modes", "packed", "--decode-buckets", "1,2", "--pipeline",
            "on", "--json", str(out)]  # fmt: skip
    assert step_profile.main(args) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["calls"]["packed"]["calls"] == r["prefill_calls"] >= 3

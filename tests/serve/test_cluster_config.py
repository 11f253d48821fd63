"""The cluster's options and its Serve config file: ClusterOptions' checks and the deployment
options they give (no Ray needed), the CLI's word when the extra is missing, and
docs/serve-cluster.yaml: valid for Ray Serve, built by the same builder as the CLI, and run
for real with `serve run` on the tiny model (skipped without ray[serve])."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from ort_kvlayout.serve.cluster.app import (
    ClusterOptions,
    ingress_options,
    replica_options,
)
from ort_kvlayout.serve.cluster.ingress_mode import ingress_environment, resolve_ingress
from serve_util import ServerProcess, free_port, library_or_skip, make_served_model

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docs" / "serve-cluster.yaml"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    library_or_skip()
    return make_served_model(tmp_path_factory.mktemp("cluster-config"))


def test_fixed_replicas_on_the_cpu():
    opts = ClusterOptions("m", replicas=2, max_batch=4, max_waiting=10)
    o = replica_options(opts, cores=8)
    assert o["num_replicas"] == 2 and "autoscaling_config" not in o
    assert o["max_ongoing_requests"] == 4 + 10 + 1  # the engine refuses the overflow, not Ray
    assert o["ray_actor_options"] == {"num_cpus": 4}  # 8 cores over 2 replicas
    assert opts.replica_threads(8) == 4
    router = o["request_router_config"]
    assert router["request_router_class"] == "ort_kvlayout.serve.cluster.router:KvLoadRouter"
    assert router["request_routing_stats_period_s"] == 0.5
    ingress = ingress_options(opts)
    assert ingress["ray_actor_options"] == {"num_cpus": 0}
    assert ingress["max_ongoing_requests"] >= 2 * (4 + 10 + 1)
    assert ingress["num_replicas"] == 1  # on the CPU the replicas share the cores with it
    # More replicas than cores: one thread each, a share of the cores each.
    assert replica_options(ClusterOptions("m", replicas=4), cores=2)["ray_actor_options"] == {
        "num_cpus": 0.5
    }
    assert replica_options(ClusterOptions("m", replicas=2, threads=3), cores=2)[
        "ray_actor_options"
    ] == {"num_cpus": 1.0}


def test_autoscaling_options_and_defaults():
    o = replica_options(ClusterOptions("m", max_replicas=4, max_batch=8), cores=4)
    assert "num_replicas" not in o
    assert o["autoscaling_config"] == {
        "min_replicas": 1, "initial_replicas": 1, "max_replicas": 4,
        "target_ongoing_requests": 8,  # a replica with every slot busy is at target
    }  # fmt: skip
    assert o["ray_actor_options"] == {"num_cpus": 1}  # threads for the most replicas
    o = replica_options(ClusterOptions("m", min_replicas=2, target_ongoing_requests=3), cores=4)
    assert o["autoscaling_config"]["min_replicas"] == o["autoscaling_config"]["max_replicas"] == 2
    assert o["autoscaling_config"]["target_ongoing_requests"] == 3


def test_ingress_replicas_follow_the_gpus_unless_given():
    """On CUDA an ingress replica per engine replica (the most, when autoscaled), so that one
    Python process does not carry every GPU's tokens; on the CPU one; or as given."""
    assert ingress_options(ClusterOptions("m", provider="cuda", replicas=4))["num_replicas"] == 4
    scaled = ClusterOptions("m", provider="cuda", min_replicas=1, max_replicas=3)
    assert ingress_options(scaled)["num_replicas"] == 3
    assert ingress_options(ClusterOptions("m", replicas=4))["num_replicas"] == 1
    given = ClusterOptions("m", provider="cuda", replicas=4, ingress_replicas=2)
    assert ingress_options(given)["num_replicas"] == 2
    assert ClusterOptions.from_args({"model_dir": "m", "ingress_replicas": 2}).ingress_count == 2


def test_one_replica_per_gpu_or_a_share_with_a_byte_budget():
    o = replica_options(ClusterOptions("m", provider="cuda", replicas=2))
    assert o["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1.0}
    shared = ClusterOptions("m", provider="cuda", replicas=2, gpus_per_replica=0.5,
                            kv_budget="8GiB")  # fmt: skip
    assert replica_options(shared)["ray_actor_options"]["num_gpus"] == 0.5
    assert shared.engine_config()["kv_budget_bytes"] == 8 << 30
    with pytest.raises(ValueError, match="sharing a GPU .* need kv_budget in bytes"):
        ClusterOptions("m", provider="cuda", gpus_per_replica=0.5, kv_budget="0.45")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 0}, "replicas must be >= 1"),
        ({"min_replicas": 3, "max_replicas": 2}, "1 <= min_replicas <= max_replicas"),
        ({"min_replicas": 0}, "1 <= min_replicas"),
        ({"threads": 0}, "threads must be >= 1"),
        ({"ingress_replicas": 0}, "ingress_replicas must be >= 1"),
        ({"target_ongoing_requests": 0}, "target_ongoing_requests must be > 0"),
        ({"kv_budget": "lots"}, "kv_budget 'lots': expected bytes"),
        ({"decode_buckets": "1,0"}, "decode_buckets '1,0'"),
        ({"max_batch": 0}, "max_batch must be >= 1"),  # EngineConfig's own check
        ({"cuda_graph": True}, "cuda_graph=True needs provider='cuda'"),
    ],
)
def test_options_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterOptions("m", **kwargs)


def test_config_args_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['replica'\]"):
        ClusterOptions.from_args({"model_dir": "m", "replica": 2})
    with pytest.raises(ValueError, match="model_dir is required"):
        ClusterOptions.from_args({"replicas": 2})


def test_cli_without_the_cluster_extra(model):
    # ray made unimportable: the CLI says which extra to install, before anything starts.
    code = (
        "import sys; sys.modules['ray'] = None; from ort_kvlayout.serve.cli import main; "
        f"sys.exit(main(['serve', {str(model)!r}, '--replicas', '2']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       check=False)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.startswith("error: --replicas needs the cluster extra")
    assert "pip install 'ort-kvlayout[cluster]'" in r.stderr


def test_cli_refuses_bad_cluster_options_before_starting(model):
    r = subprocess.run(
        [sys.executable, "-m", "ort_kvlayout.serve.cli", "serve", str(model), "--replicas", "2",
         "--max-replicas", "3"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--replicas is a fixed count" in r.stderr or "cluster extra" in r.stderr


def test_ingress_environment():
    env = ingress_environment("haproxy")
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    ports = {int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])}
    assert len(ports) == 2 and all(p > 0 for p in ports)  # free ones, not Ray's fixed defaults
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) < 30  # Ray's default
    assert ingress_environment("proxy") == {
        "RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0",
    }  # fmt: skip
    with pytest.raises(ValueError, match="--ingress 'nginx': one of haproxy, proxy"):
        ingress_environment("nginx")


def test_the_default_ingress_follows_the_haproxy_binary(monkeypatch, tmp_path):
    import ort_kvlayout.serve.cluster.ingress_mode as im

    monkeypatch.setattr(im, "haproxy_binary_found", lambda: True)
    assert resolve_ingress(None) == ("haproxy", None)
    assert resolve_ingress("proxy") == ("proxy", None)
    monkeypatch.setattr(im, "haproxy_binary_found", lambda: False)
    mode, note = resolve_ingress(None)
    assert mode == "proxy" and "no HAProxy binary" in note
    with pytest.raises(ValueError, match="--ingress haproxy needs an HAProxy binary"):
        resolve_ingress("haproxy")
    monkeypatch.undo()
    # RAY_SERVE_HAPROXY_BINARY_PATH decides when set, as it does for Ray
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "absent"))
    assert not im.haproxy_binary_found()
    exe = tmp_path / "haproxy"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(exe))
    assert im.haproxy_binary_found()


def test_cli_refuses_an_ingress_for_a_joined_cluster(model):
    r = subprocess.run(
        [sys.executable, "-m", "ort_kvlayout.serve.cli", "serve", str(model), "--address",
         "auto", "--ingress", "proxy"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--ingress proxy with --address" in r.stderr
    assert "RAY_SERVE_ENABLE_HA_PROXY" in r.stderr


def completion_tokens(url: str, prompt: str, max_tokens: int = 3) -> int:
    """A non-streamed /v1/completions of model "tiny" through `url`: its completion tokens."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def test_cli_proxy_ingress_serves(model):
    """--ingress proxy: Ray's Python proxy actor, no HAProxy; the same API."""
    pytest.importorskip("ray.serve")
    psutil = pytest.importorskip("psutil")
    proc = ServerProcess(model, "--replicas", "1", "--ingress", "proxy", "--model-id", "tiny")
    try:
        proc.wait_ready(timeout=180)
        tree = psutil.Process(proc.proc.pid).children(recursive=True)
        assert tree and not any(p.name() == "haproxy" for p in tree)
        assert completion_tokens(proc.url, "abc") == 3
    finally:
        code, _, err = proc.stop(timeout=120)
    assert code == 0, err


def test_cli_two_ingress_replicas_serve(model):
    """--ingress-replicas 2: two HTTP ingress processes in front of one engine replica, HAProxy
    (or Ray's proxy) spreading the connections; every request answered, /metrics whole."""
    pytest.importorskip("ray.serve")
    psutil = pytest.importorskip("psutil")
    proc = ServerProcess(model, "--replicas", "1", "--ingress-replicas", "2", "--model-id", "tiny")
    try:
        proc.wait_ready(timeout=180)
        tree = psutil.Process(proc.proc.pid).children(recursive=True)
        ingresses = [p for p in tree if "OpenAIIngress" in " ".join(p.cmdline())]
        assert len(ingresses) == 2, [p.cmdline() for p in tree]
        with ThreadPoolExecutor(8) as pool:
            prompts = [f"abc {i}" for i in range(16)]
            assert list(pool.map(lambda p: completion_tokens(proc.url, p), prompts)) == [3] * 16
        with urllib.request.urlopen(proc.url + "/metrics", timeout=30) as r:
            assert 'replica="' in r.read().decode()
    finally:
        code, _, err = proc.stop(timeout=120)
    assert code == 0, err


def test_cli_checks_the_model_before_ray_starts(model, tmp_path):
    pytest.importorskip("ray.serve")
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    cfg = json.loads((broken / "genai_config.json").read_text())
    cfg["model"]["decoder"]["num_hidden_layers"] = 10**9
    (broken / "genai_config.json").write_text(json.dumps(cfg))
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "ort_kvlayout.serve.cli", "serve", str(broken), "--replicas", "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "num_hidden_layers = 1000000000 is out of range" in r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - start < 60


def config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def test_docs_config_is_a_serve_config_of_this_builder(model):
    schema = pytest.importorskip("ray.serve.schema")
    from ort_kvlayout.serve.cluster import app
    from ray.serve import Application

    cfg = config()
    schema.ServeDeploySchema.model_validate(cfg)
    (application,) = cfg["applications"]
    assert application["import_path"] == "ort_kvlayout.serve.cluster.app:build"
    opts = ClusterOptions.from_args(application["args"])
    assert opts.replicas == 2 and not opts.autoscaling
    args = {**application["args"], "model_dir": str(model)}
    assert isinstance(app.build(args), Application)
    with pytest.raises(ValueError, match="no genai_config.json"):
        app.build({**args, "model_dir": str(model.parent)})


def http(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_serve_run_of_the_docs_config(model, tmp_path):
    pytest.importorskip("ray.serve")
    cfg = config()
    port = free_port()
    cfg["http_options"]["port"] = port
    cfg["applications"][0]["args"].update(model_dir=str(model), max_batch=2, model_id="tiny")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    serve = Path(sys.executable).parent / "serve"
    env = {k: v for k, v in os.environ.items() if k != "ORT_KVLAYOUT_API_KEY"}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([str(serve), "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if http(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except (OSError, ValueError):  # not listening yet, or Serve's own 404 page
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "serve run did not become ready"
            time.sleep(0.5)
        status, out = http(
            f"http://127.0.0.1:{port}/v1/completions",
            {"model": "tiny", "prompt": "abc", "max_tokens": 4, "ignore_eos": True},
        )
        assert status == 200 and out["usage"]["completion_tokens"] == 4
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        deadline = time.monotonic() + 30
        while b'ort_kvlayout_replicas{model="tiny"} 2' not in text:
            assert time.monotonic() < deadline, text.decode()[-500:]
            time.sleep(0.5)
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""Without network: a Hub model or dataset that is not cached fails in seconds with one message; a cached model
still loads. Every Hub address here is on this machine (a refused port, or a local server), never the real Hub."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from rlhf.core import hub
from rlhf.core.errors import UserError
from tests.conftest import ROOT

# Run in a fresh process: huggingface_hub reads HF_HOME and HF_ENDPOINT when it is imported.
_SCENARIOS = r"""
import json, os, sys, time
from pathlib import Path
from rlhf.core.errors import UserError
from rlhf.models.loading import load_policy
from rlhf.embedded.tiny_model import TinySpec

def attempt(name):
    start = time.perf_counter()
    try:
        policy = load_policy(name)
        result = f"loaded {type(policy.model).__name__}"
    except UserError as error:
        result = f"UserError: {error}"
    return {"result": result, "seconds": time.perf_counter() - start}

# A model in the Hub cache's layout, as a download leaves it: snapshots/<commit>/ and refs/main.
repo = Path(os.environ["HF_HOME"]) / "hub" / "models--someone--cached-tiny"
snapshot = repo / "snapshots" / ("0" * 40)
policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
policy.model.save_pretrained(snapshot)
policy.tokenizer.save_pretrained(snapshot)
(repo / "refs").mkdir()
(repo / "refs" / "main").write_text("0" * 40)

results = {"unreachable": attempt("openai-community/gpt2"), "unreachable_cached": attempt("someone/cached-tiny")}
os.environ["HF_HUB_OFFLINE"] = "1"
results["offline"] = attempt("openai-community/gpt2")
results["offline_cached"] = attempt("someone/cached-tiny")
print(json.dumps(results))
"""


def _refused_address() -> str:
    """An address on this machine where nothing listens: a connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_an_uncached_hub_model_fails_in_seconds_without_network_and_a_cached_one_loads(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=_refused_address(), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _SCENARIOS], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    fix = ("Fix: run once with network to download it, or point model.name_or_path at a local folder.")
    assert results["unreachable"]["result"] == (
        "UserError: model.name_or_path=openai-community/gpt2: not in the local Hugging Face cache and the Hub cannot "
        f"be reached (no network: {env['HF_ENDPOINT']} did not answer). {fix}")
    assert results["offline"]["result"] == (
        "UserError: model.name_or_path=openai-community/gpt2: not in the local Hugging Face cache and the Hub cannot "
        f"be reached (HF_HUB_OFFLINE=1). {fix}")
    assert results["unreachable_cached"]["result"] == results["offline_cached"]["result"] == "loaded LlamaForCausalLM"
    for case in ("unreachable", "offline"):
        assert results[case]["seconds"] < 10, results
    assert "Retrying" not in out.stderr  # no retry loop was entered
    assert time.perf_counter() - start < 90  # the whole process, imports included (about 10 s)


# ---- the reachability check itself --------------------------------------------------------------------------------
@pytest.fixture
def online(monkeypatch):
    """Offline mode off, in the environment and in huggingface_hub (which read it when first imported)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


@pytest.fixture
def local_hub(monkeypatch, online):
    """Point the check at an address on this machine; forget earlier answers."""
    monkeypatch.setattr(hub, "_reachable", {})

    def use(address: str) -> None:
        monkeypatch.setattr(hub, "endpoint", lambda: address)

    return use


def test_any_http_answer_means_reachable(local_hub):
    class NotFound(BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 (the http.server name)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        local_hub(f"http://127.0.0.1:{server.server_address[1]}")
        assert hub.reachable(timeout_s=5)
    finally:
        server.shutdown()
        server.server_close()


def test_a_hub_that_never_answers_is_unreachable_after_the_timeout(local_hub):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        local_hub(f"http://127.0.0.1:{silent.getsockname()[1]}")
        start = time.perf_counter()
        assert not hub.reachable(timeout_s=0.5)
        assert time.perf_counter() - start < 5


def test_the_answer_is_asked_once_per_process(local_hub, monkeypatch):
    local_hub(_refused_address())
    assert not hub.reachable()
    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: pytest.fail("asked the Hub again"))
    assert not hub.reachable()


def test_offline_mode_reads_the_environment_when_asked(monkeypatch, online):
    assert not hub.offline_mode()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.offline_mode() and hub.offline_mode(datasets=True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # datasets' own switch decides for datasets
    assert hub.offline_mode() and not hub.offline_mode(datasets=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")
    assert hub.offline_mode()


# ---- datasets -----------------------------------------------------------------------------------------------------
def test_a_hub_dataset_without_network_fails_in_seconds_with_one_message(monkeypatch, tmp_path, online):
    from rlhf.data.source import DataSource

    monkeypatch.setattr(hub, "reachable", lambda timeout_s=hub.REACH_TIMEOUT_S: False)
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    start = time.perf_counter()
    with pytest.raises(UserError) as error:
        DataSource("someone/some-preference-data").load_raw(["prompt", "chosen", "rejected"])
    assert time.perf_counter() - start < 5
    message = str(error.value)
    assert message.startswith("data.path=someone/some-preference-data: the Hub cannot be reached (no network: ")
    assert "HF_HUB_OFFLINE=1" in message and "Fix:" in message


def test_a_local_folder_of_data_files_is_not_taken_for_a_hub_id(monkeypatch, tmp_path, online):
    from rlhf.data.source import DataSource

    monkeypatch.setattr(hub, "reachable", lambda timeout_s=hub.REACH_TIMEOUT_S: pytest.fail("asked the Hub"))
    folder = tmp_path / "prefs"
    folder.mkdir()
    rows = [{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    splits = DataSource(str(folder)).load_raw(["prompt", "chosen", "rejected"])
    assert len(splits["train"]) + len(splits["eval"]) == 6

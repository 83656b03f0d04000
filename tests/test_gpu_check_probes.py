"""The GPU check's preflight probes (benchmarks/gpu_check/sections/probes.py) can fail: each compares its GPU path
with a reference that shares none of its code, and is red here under the break its docstring names; a section in
which torch's compiler hits its recompile limit fails (benchmarks/gpu_check/recompiles.py). The probes' passing runs
are the CPU rehearsal's (tests/test_gpu_check.py: its preflight rows)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_check import recompiles  # noqa: E402
from gpu_check.sections import preflight, probes  # noqa: E402
from gpu_check.workers import isolated, turns  # noqa: E402


def provoke_recompile_limit() -> str:
    """A function compiled (eager backend) for more shapes than a recompile limit of 2 allows."""
    torch._dynamo.config.recompile_limit = 2

    @torch.compile(backend="eager", dynamic=False)
    def double(x):
        return x * 2

    for n in range(1, 6):
        double(torch.ones(n))
    return "ran"


def test_the_decoding_probe_is_red_when_generate_samples_at_another_temperature():
    """Break: the reference (transformers' generate) at temperature 1 while the static decoder samples at 0.7. The
    greedy completions still agree; the sampled ones do not."""
    model = probes.decoding_policy("cpu", layers_compiled=False)
    assert "tokens equal" in probes.compare_decoders(model, "cpu")
    with pytest.raises(probes.ProbeFailed, match=r"static decoding \(sampled, seed 7\) gave other tokens"):
        probes.compare_decoders(model, "cpu", reference_sampling={**probes.DECODING_SAMPLING, "temperature": 1.0})
    with pytest.raises(probes.ProbeFailed, match="sampled"):  # nucleus sampling left out of the reference
        probes.compare_decoders(model, "cpu", reference_sampling={**probes.DECODING_SAMPLING, "top_p": 1.0})


def test_the_float64_comparison_catches_a_missing_temperature_or_bias():
    """The Triton probe's comparison (run on a GPU against the kernel, and in the rehearsal under Triton's
    interpreter), given the output layer's torch twin: within 1e-3 of float64; and red for a layer that forgets
    1 / T, for one that drops the bias, and against a reference whose temperature is 0.1% off (0.02 nats, which the
    earlier tolerance of 3e-2 let through: red when the tolerance is loosened to it)."""
    from rlhf.ops.token_logps import linear_log_softmax

    def twin(h, w, b, index, start, temperature):
        return linear_log_softmax(h, w, b, index, start=start, temperature=temperature, triton=False)[0]

    def no_temperature(h, w, b, index, start, temperature):
        return twin(h, w, b, index, start, 1.0)

    def no_bias(h, w, b, index, start, temperature):
        return twin(h, w, None, index, start, temperature) + 0 * b.sum()

    shape = probes.TRITON_SHAPES["cpu"]
    assert "max |Δ logp|" in probes.compare_with_float64(twin, "cpu", shape)
    for broken in (no_temperature, no_bias):
        with pytest.raises(probes.ProbeFailed, match="differs from float64"):
            probes.compare_with_float64(broken, "cpu", shape)
    with pytest.raises(probes.ProbeFailed, match=r"differs from float64: .* max \|Δ logp\| 2\.0e-02"):
        probes.compare_with_float64(twin, "cpu", shape, reference_temperature=probes.TEMPERATURE * 1.001)


def test_the_flex_probe_is_red_when_its_reference_sees_across_pairs():
    """Break: the sdpa side given a plain causal mask of its own instead of the dense mask layout_masks builds (every
    token sees the pairs before it). The flex side is layout_masks' own BlockMask, with blocks skipped."""
    def causal(batch):
        length = batch["input_ids"].shape[1]
        return torch.ones(length, length, dtype=torch.bool).tril()[None, None]

    with pytest.raises(probes.ProbeFailed, match=r"differs from sdpa.*blocks skipped: logits"):
        probes.compare_attention("cpu", backward=False, pairs=3, reference_mask=causal)


def test_the_compiled_layers_probe_is_red_when_the_compiled_model_computes_something_else(monkeypatch):
    """Break: a "compilation" that changes one weight (a wrong graph, as far as the probe can tell). The probe's
    passing run, inductor on the CPU, is the rehearsal's."""
    from rlhf.hardware import compiling

    def miscompiled(model, compile):
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(1.01)

    monkeypatch.setattr(compiling, "compile_model", miscompiled)
    with pytest.raises(probes.ProbeFailed, match="compiled layers differ from eager"):
        probes.compiled_layers("cpu")


def test_a_section_that_hits_the_recompile_limit_fails_in_this_process_and_in_its_own():
    """Dynamo's warning, caught by its logger: a probe run here fails its row; a function run in a process of its own
    fails its call; a worker's answer that carries one fails its side; a run's output is read for it. Red when the
    watch listens on another logger, or the limit's name changes in the warning."""
    # torch's config.patch restores the limit (pytest's monkeypatch would delete the config entry on undo: later
    # compiles in this process would then fail reading it)
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        [row] = preflight.preflight("cpu", [("compiled too often", lambda device: provoke_recompile_limit(),
                                             "hardware.compile=layers")])
    assert row["ok"] is False and "hit torch's recompile limit" in row["value"], row
    assert "torch._dynamo hit config.recompile_limit (2)" in row["value"], row
    with pytest.raises(isolated.IsolatedFailed, match="recompile limit"):
        isolated.call("tests.test_gpu_check_probes:provoke_recompile_limit", [], 120)
    log = ("W1129 10:32:57 convert_frame.py:1994] [0/2] torch._dynamo hit config.recompile_limit (8)\n"
           "W1129 10:32:57 convert_frame.py:1994] [0/2]    function: 'forward' (modeling_llama.py:290)\n")
    assert recompiles.hits_in(log) == ["torch._dynamo hit config.recompile_limit (8); 'forward' (modeling_llama.py:290)"]
    assert recompiles.hits_in("torch._dynamo hit config.cache_size_limit (8)") != []  # torch before 2.6
    assert recompiles.hits_in("recompiled 3 times") == []


class _Pipe:
    def write(self, text):
        pass

    def flush(self):
        pass


def test_a_side_whose_answer_says_the_limit_was_hit_fails():
    import queue

    worker = object.__new__(turns.Worker)  # its reading of answers, without a process
    worker.kind, worker.prefix, worker.answers, worker.tail = "ours", "[ours] ", queue.Queue(), []
    worker.process = type("Process", (), {"stdin": _Pipe()})()
    worker.answers.put({"samples_per_s": 1.0, "recompile_limit": ["torch._dynamo hit config.recompile_limit (8)"]})
    with pytest.raises(turns.SideFailed, match=r"\[ours\] run hit torch's recompile limit"):
        worker.ask({"op": "run", "steps": 1}, float("inf"))
    worker.answers.put({"samples_per_s": 1.0})
    assert worker.ask({"op": "run", "steps": 1}, float("inf")) == {"samples_per_s": 1.0}

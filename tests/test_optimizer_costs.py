"""benchmarks/optimizer_costs.py: the state it counts and the options it reports, without running the benchmark."""

from __future__ import annotations

import importlib.util
import sys

import torch

from tests.conftest import ROOT, fast_initial_model

_spec = importlib.util.spec_from_file_location("optimizer_costs", ROOT / "benchmarks" / "optimizer_costs.py")
costs = importlib.util.module_from_spec(_spec)
sys.modules["optimizer_costs"] = costs
_spec.loader.exec_module(costs)


def test_state_bytes_counts_nested_tensors_once_each_by_dtype():
    """Red when nested containers are not walked (the list's uint8 codes missing) or when a tensor reached twice,
    or a view of one, is counted again (float32 over 40 bytes)."""
    moment = torch.zeros(10)  # 40 bytes
    codes = torch.zeros(8, dtype=torch.uint8)
    state = {0: {"exp_avg": moment, "again": moment, "view": moment[:5], "nested": [{"codes": (codes,)}]},
             1: {"step": torch.tensor(1.0)}}
    assert costs.state_bytes(state) == {"float32": 40 + 4, "uint8": 8}


def test_an_optimizer_whose_library_is_missing_is_reported_as_such():
    """Red when an ImportError behind the error (a UserError naming the missing library, raised from the ImportError) is reported as a crash."""
    try:
        try:
            raise ModuleNotFoundError("No module named 'heavyball'", name="heavyball")
        except ModuleNotFoundError as error:
            raise RuntimeError("optimizer=soap needs the package heavyball") from error
    except RuntimeError as error:
        assert costs.why_not(error)["status"] == "library missing"
    assert costs.why_not(ValueError("bad"))["status"] == "error"


def test_a_variant_builds_its_option_with_its_overrides():
    """Red when ``--variant``'s overrides do not reach the composed config (Muon's row with ns_dtype=bfloat16 would
    time the float32 step again)."""
    model = fast_initial_model()
    for overrides, expected in (((), "auto"), (("optimizer.ns_dtype=bfloat16",), "bfloat16")):
        _, optimizer = costs.build_optimizer("muon", model, None, overrides)
        assert optimizer.rules["muon"].ns_dtype == expected
    assert costs.label("muon", ("optimizer.ns_dtype=bfloat16",)) == "muon (optimizer.ns_dtype=bfloat16)"


def test_muon_compile_swaps_each_dtypes_iteration_and_puts_it_back():
    """Red when the compiled Newton-Schulz iteration is put where the step does not look it up, or left in place
    after its variant (every later variant would be compiled too)."""
    from torch.optim import _muon

    from rlhf.optim import rules

    spec = importlib.util.spec_from_file_location("muon_compile", ROOT / "benchmarks" / "muon_compile.py")
    muon_compile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(muon_compile)
    for module, name in ((rules, "orthogonalize"), (_muon, "_zeropower_via_newtonschulz")):
        eager = getattr(module, name)
        with muon_compile.compiled_iteration("float32" if module is rules else "bfloat16"):
            assert getattr(module, name) is not eager
        assert getattr(module, name) is eager

"""The collectives module is the one place that talks to other processes, and its functions answer with one process
as they do with several (two-process behaviour is tested end to end: tests/hardware/test_data_parallel.py and the
sharded tests sum, gather and agree through it)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import rlhf
from rlhf.ops import collectives

PACKAGE = Path(rlhf.__file__).parent
HOME = PACKAGE / "ops" / "collectives.py"
# torch.distributed's collectives, and Accelerate's, by the name a call uses
CROSS_PROCESS = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all", "broadcast",
                 "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
                 "gather_object", "scatter", "send", "recv", "barrier_sum", "gather_for_metrics",
                 "pad_across_processes"}


def _receiver(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def cross_process_calls(source: str) -> list[str]:
    """The calls in ``source`` of a collective on ``torch.distributed`` (``dist``) or on an accelerator."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CROSS_PROCESS:
            receiver = _receiver(node.func.value)
            if receiver in ("torch.distributed", "dist") or receiver.split(".")[-1] == "accelerator":
                found.append(f"{receiver}.{node.func.attr} (line {node.lineno})")
    return found


def test_no_module_but_collectives_calls_a_collective():
    """Every cross-process sum, gather and agreement goes through rlhf.ops.collectives (red: a hand-rolled
    ``torch.distributed.all_gather`` in an algorithm, or ``accelerator.reduce`` in a reference strategy)."""
    elsewhere = {str(path.relative_to(PACKAGE.parent)): calls for path in sorted(PACKAGE.rglob("*.py"))
                 if path != HOME and (calls := cross_process_calls(path.read_text()))}
    assert elsewhere == {}, f"collectives outside rlhf/ops/collectives.py: {elsewhere}"
    assert cross_process_calls(HOME.read_text()), "the detector finds nothing in the collectives module itself"


def test_the_detector_sees_each_spelling():
    source = ("torch.distributed.all_reduce(x)\ndist.all_gather(parts, x)\nself.accelerator.reduce(x)\n"
              "accelerator.gather(x)\nlogits.gather(-1, index)\nfunctools.reduce(f, xs)\n")
    assert [call.split(" ")[0] for call in cross_process_calls(source)] == [
        "torch.distributed.all_reduce", "dist.all_gather", "self.accelerator.reduce", "accelerator.gather"]


class _OneProcess:
    num_processes, device = 1, torch.device("cpu")


def test_one_process_gets_its_own_values_back():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert collectives.processes() == 1
    assert collectives.sum_over_processes({"b": torch.tensor(2.0), "a": 1}, _OneProcess()) == {"a": 1.0, "b": 2.0}
    assert collectives.any_process({"stop": True, "skip": False}, _OneProcess()) == {"skip": False, "stop": True}
    assert collectives.max_over_processes(3.5, _OneProcess()) == 3.5
    assert torch.equal(collectives.sum_over_every_process(values), values)
    assert collectives.flag_on_any_process(True, "cpu") is True
    rows, mine = collectives.gather_rows(values, "cpu")
    assert torch.equal(rows, values) and mine == slice(0, 2)
    assert len(collectives.gather_equal(values)) == 1
    assert collectives.from_main_process(values, _OneProcess()) is values

"""optimizer=soap and optimizer=psgd_kron (heavyball, rlhf/optim/preconditioned.py): each does what its paper says on
a small problem, a misspelt field or a sharded strategy is refused before anything loads, kernels are not compiled
on a CPU unless asked, and a run resumed from a checkpoint ends as the uninterrupted one, bit for bit."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import FAST, assert_equal_trees, compose_config, installed

pytestmark = pytest.mark.skipif(not installed("heavyball"), reason="needs rlhf[optimizers] (heavyball)")


def _spd(n: int, cond: float, generator: torch.Generator) -> torch.Tensor:
    """A random n x n symmetric positive definite matrix with condition number ``cond``."""
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return (q @ torch.diag(torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64))
            @ q.T).float()


def _condition(matrix: torch.Tensor) -> float:
    values = torch.linalg.eigvalsh(matrix.double())
    return (values.max() / values.min()).item()


def _stepped(optimizer_class, steps: int, **settings):
    """An 8 x 6 matrix stepped ``steps`` times (lr 0) on gradients G = L Z R whose row and column covariances each
    have condition number 100: its state and the two factors."""
    generator = torch.Generator().manual_seed(0)
    left, right = _spd(8, 10.0, generator), _spd(6, 10.0, generator)
    weight = torch.nn.Parameter(torch.zeros(8, 6))
    optimizer = optimizer_class([weight], lr=0.0, compile=False, **settings)
    for _ in range(steps):
        weight.grad = left @ torch.randn(8, 6, generator=generator) @ right
        optimizer.step()
    return optimizer.state[weight][0], left, right


def test_soap_keeps_orthogonal_eigenbases_of_the_gradient_statistics():
    """Vyas et al. 2024 (arXiv:2409.11321): after a preconditioner refresh, SOAP's state holds orthogonal bases Q_L,
    Q_R that diagonalize the running statistics E[G G^T], E[G^T G]. Red when the refresh does not run (heavyball's
    get_orthogonal_matrix_QR made a no-op: the bases stay those of the first gradient)."""
    from rlhf.optim.preconditioned import SOAP

    state, _, _ = _stepped(SOAP, 30, precondition_frequency=1)
    bases = next(v for k, v in state.items() if "_Q_" in k)
    statistics = next(v for k, v in state.items() if "_GG_" in k)
    assert [tuple(q.shape[-2:]) for q in bases] == [(8, 8), (6, 6)]
    for q, gg in zip(bases, statistics):
        q, gg = q[0].double(), gg[0].double()
        torch.testing.assert_close(q.T @ q, torch.eye(len(q), dtype=torch.float64), atol=1e-5, rtol=0)
        rotated = q.T @ gg @ q
        off = rotated - torch.diag(torch.diag(rotated))
        assert off.norm() < 0.05 * rotated.norm(), f"Q^T GG Q is not diagonal: {off.norm():.3g} off the diagonal"


def test_psgd_kron_whitens_the_gradient():
    """Li 2015/2018 (arXiv:1512.04202): PSGD fits P = (Q_R^T Q_R) kron (Q_L^T Q_L) so that P whitens the gradient.
    Gradients G = L Z R (Z standard normal) have row covariance L L^T and column covariance R^T R, each of condition
    number 100; after 150 preconditioner updates each factor brings its covariance near a multiple of the identity
    (P C P's condition number below 10). Red when the preconditioner is not updated (heavyball's chainable._update_psgd_precond
    made a no-op: P stays at its initial scale, condition number 100)."""
    import heavyball

    from rlhf.optim.preconditioned import PSGDKron

    state, left, right = _stepped(PSGDKron, 150, beta=0.0)
    factors = next(v for k, v in state.items() if "_Q_" in k)
    q_left, q_right = (heavyball.utils.line_to_triu([f])[0][0] for f in factors)  # stored as upper-triangle lines
    for q, covariance in ((q_left, left @ left.T), (q_right, right.T @ right)):
        p = (q.T @ q).double()
        assert _condition(covariance) > 90
        assert _condition(p @ covariance.double() @ p) < 10


def test_heavyball_kernels_run_eagerly_on_a_cpu_unless_asked(monkeypatch):
    """compile=auto: heavyball's module-global compile mode is None (eager) during a step on CPU tensors; true: the
    library's mode; after the step the global holds what it held before (another value here, to tell them apart).
    Red when the wrapper leaves the library's default in place (75 s of autotuning per run), or when it does not
    put the previous value back (the process-wide setting changed behind the user's back)."""
    import heavyball

    from rlhf.optim import preconditioned

    seen = []
    library_step = heavyball.utils.StatefulOptimizer.step

    def recording_step(self, closure=None):
        seen.append(heavyball.utils.compile_mode)
        return library_step(self, closure)

    monkeypatch.setattr(heavyball.utils.StatefulOptimizer, "step", recording_step)
    monkeypatch.setattr(heavyball.utils, "compile_mode", "the user's mode")
    weight = torch.nn.Parameter(torch.ones(3, 2))
    assert preconditioned._compiles(True, [weight]) and not preconditioned._compiles(False, [weight])
    optimizer = preconditioned.SOAP([weight], lr=1e-3)  # compile=auto
    weight.grad = torch.ones(3, 2)
    optimizer.step()
    assert seen == [None]
    assert heavyball.utils.compile_mode == "the user's mode"


@pytest.mark.parametrize("option", ["SOAP", "PSGDKron"])
def test_the_gradients_are_left_for_the_loop(option):
    """After step() every gradient is the one the backward pass left (heavyball's consume_grad off): the loop zeroes
    it after the step, as for every optimizer. Red when heavyball clears them (consume_grad left at its default)."""
    from rlhf.optim import preconditioned

    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.ones(5, 4)), torch.nn.Parameter(torch.ones(4))
    optimizer = getattr(preconditioned, option)([weight, bias], lr=1e-2, compile=False)
    for _ in range(3):
        grads = [torch.randn(5, 4, generator=generator), torch.randn(4, generator=generator)]
        weight.grad, bias.grad = (g.clone() for g in grads)
        optimizer.step()
        assert weight.grad is not None and bias.grad is not None
        assert torch.equal(weight.grad, grads[0]) and torch.equal(bias.grad, grads[1])


SIDE_EFFECTS: list[str] = []


def _side_effect(what: str) -> None:
    """What a malicious checkpoint's pickle would call when loaded."""
    SIDE_EFFECTS.append(what)


class _Malicious:
    """An object whose unpickling calls :func:`_side_effect` (pickle's ``__reduce__``: any callable, any arguments)."""

    def __reduce__(self):
        return _side_effect, ("code ran while loading a checkpoint",)


def _objects(tree):
    """Every leaf of a state dict (dictionaries, lists and tuples walked)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield key
            yield from _objects(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _objects(value)
    else:
        yield tree


@pytest.mark.parametrize("option", ["SOAP", "PSGDKron"])
def test_a_checkpoint_holds_no_pickle_and_loading_one_runs_no_code(option):
    """heavyball pickles its preconditioner schedule into the state dict and unpickles it when loading. The saved
    state dict holds no bytes anywhere; a state dict whose ``precond_schedule`` is a pickle with a side effect loads
    (through ``torch.load(weights_only=True)``, as a checkpoint does) without the side effect, and the optimizer
    keeps the schedule its constructor built. Red without the wrapper's hooks (the bytes saved; the side effect
    runs in heavyball's load hook)."""
    import pickle

    from rlhf.optim import preconditioned

    cls = getattr(preconditioned, option)
    weight = torch.nn.Parameter(torch.ones(5, 4))
    optimizer = cls([weight], lr=1e-2, compile=False)
    for _ in range(2):
        weight.grad = torch.ones(5, 4)
        optimizer.step()
    saved = optimizer.state_dict()
    assert "heavyball" in saved and saved["heavyball"]["inner_group"]
    assert not [x for x in _objects(saved) if isinstance(x, (bytes, bytearray))]

    blob = pickle.dumps(_Malicious())
    SIDE_EFFECTS.clear()
    pickle.loads(blob)
    assert SIDE_EFFECTS, "the blob must have a side effect for this test to mean anything"
    SIDE_EFFECTS.clear()
    buffer = io.BytesIO()
    torch.save({**saved, "heavyball": {**saved["heavyball"], "precond_schedule": blob}}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["heavyball"]["precond_schedule"] == blob  # torch returns the bytes untouched
    fresh = cls([torch.nn.Parameter(torch.ones(5, 4))], lr=1e-2, compile=False)
    schedule = fresh.precond_schedule
    fresh.load_state_dict(loaded)
    assert SIDE_EFFECTS == []
    assert fresh.precond_schedule is schedule
    assert fresh.inner_group == saved["heavyball"]["inner_group"]  # the rest of heavyball's entry still loads
    assert loaded["heavyball"]["precond_schedule"] == blob  # the caller's dict left as it was


@pytest.mark.parametrize(("option", "override", "expected"), [
    ("soap", "+optimizer.shampo_beta=0.9", "shampoo_beta"),
    ("psgd_kron", "+optimizer.precond_lrr=0.1", "precond_lr"),
    ("soap", "optimizer.compile=sometimes", "optimizer.compile=auto"),
    ("psgd_kron", "optimizer.preconditioner_update_probability=1.5", "preconditioner_update_probability"),
    ("soap", "hardware=fsdp", "hardware=fsdp"),
    ("psgd_kron", "hardware=zero2", "hardware=zero2"),
])
def test_bad_settings_are_refused_before_loading(option, override, expected):
    """A misspelt field (red when ``_target_`` takes open ``**kwargs``, as a factory function forwarding them to
    heavyball, whose constructors take them too), an unknown compile value, an out-of-range probability, and a
    strategy that shards matrices (red without ``whole_matrices``): refused by the checks, naming the field."""
    from rlhf.config.checks import check_config
    from rlhf.core.errors import UserError

    with pytest.raises(UserError, match=expected.replace("+", r"\+").replace(".", r"\.")):
        check_config(compose_config(f"optimizer={option}", override))


@pytest.mark.parametrize(("option", "extra"), [("soap", ["optimizer.precondition_frequency=2"]), ("psgd_kron", [])])
def test_a_run_resumes_bit_for_bit(tmp_path, option, extra):
    """Four steps in one run, and two steps + a resume to four, end with the same weights and optimizer state
    (SOAP's bases refreshed at steps 2 and 4, across the resume; PSGD's preconditioner updated at every step from
    torch's generator), the saved optimizer state holds no bytes (no pickle), and the logged gradient norms are the
    pre-clip norms. Red when the loaded state is cast to the parameters' dtype (torch's load_state_dict
    without the wrapper's hooks: PSGD's float64 lower bounds come back float32)."""
    from rlhf import train
    from rlhf.run import checkpoint

    run = [*FAST, "algo=dpo", f"optimizer={option}", *extra, "scheduler=constant", "train.eval_at_start=false",
           "train.save_every_steps=2", "train.keep_last=null", "train.max_grad_norm=0.5"]
    train(compose_config(*run, "train.max_steps=4", output_dir=tmp_path / "whole"))
    train(compose_config(*run, "train.max_steps=2", output_dir=tmp_path / "resumed"))
    train(compose_config(*run, "train.max_steps=4", "resume=auto", "resume_changes=[train.max_steps]",
                         output_dir=tmp_path / "resumed"))
    left, right = (load_file(tmp_path / r / "final" / "model.safetensors") for r in ("whole", "resumed"))
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left), "parameters differ"
    last = f"{checkpoint.FOLDER}/{checkpoint.PREFIX}{4:08d}/optimizer.pt"
    x, y = (torch.load(tmp_path / r / last, weights_only=True) for r in ("whole", "resumed"))
    assert len(x["state"]) > 0
    assert_equal_trees(x["state"], y["state"], "optimizer.pt/state")
    assert x["heavyball"]["inner_group"] == y["heavyball"]["inner_group"]
    assert not [v for v in _objects(x) if isinstance(v, (bytes, bytearray))]
    lines = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    norms = [line["train/grad_norm"] for line in lines if "train/grad_norm" in line]
    assert len(norms) == 4 and all(0.5 < norm < 1e3 for norm in norms), norms  # measured before the clip to 0.5

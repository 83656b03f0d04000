"""optimizer=ademamix, ademamix8bit and lion8bit (bitsandbytes) do what they claim, on CPU tensors:

- AdEMAMix's 32-bit update is the paper's (Pagliardini et al. 2024, arXiv:2409.03137, Algorithm 1 with its alpha and
  beta3 schedulers), written here with torch ops, for steps inside and past both warmups; a null warmup is the run's
  length once :func:`rlhf.optim.set_run_length` has been called;
- the 8-bit variant holds uint8 states in tensors of at least ``min_8bit_size`` elements (float32 below) and stays
  within quantization tolerance of the 32-bit one;
- Lion8bit's update is ``lr x sign(...)`` per element plus decoupled weight decay, as optimizer=lion (lion-pytorch),
  to the tolerance its 8-bit momentum allows;
- the options' values are checked before anything loads.
"""

from __future__ import annotations

import math

import hydra
import pytest
import torch

from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.optim import set_run_length
from rlhf.optim.quantized import AdEMAMix
from tests.conftest import ROOT, compose_config

BIG = (64, 128)  # 8192 elements: above bitsandbytes' min_8bit_size (4096), so an 8-bit state is 8-bit
SMALL = (48,)  # below it: float32 states even in an 8-bit optimizer


def _build(option: str, params, **overrides):
    """The optimizer ``conf/optimizer/<option>.yaml`` builds for ``params`` (its partial, called as the run calls it)."""
    cfg = compose_config(f"optimizer={option}")
    return hydra.utils.instantiate(cfg.optimizer)(params, **overrides)


def _gradients(seed: int, shapes, steps: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]


def _params(shapes, seed: int = 1) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _run(optimizer, params, gradients) -> None:
    for step in gradients:
        for param, grad in zip(params, step):
            param.grad = grad.clone()
        optimizer.step()


def _paper_ademamix(param, gradients, lr, betas, alpha, eps, weight_decay, t_alpha, t_beta3) -> torch.Tensor:
    """AdEMAMix in float64 as the paper writes it: m1 (bias-corrected), m2 (not), nu (bias-corrected);
    alpha_t = min(t alpha / T_alpha, alpha); beta3_t = min(exp(ln b1 ln b3 / ((1 - t/T) ln b3 + (t/T) ln b1)), b3);
    theta -= lr ((m1_hat + alpha_t m2) / (sqrt(nu_hat) + eps) + weight_decay theta)."""
    beta1, beta2, beta3 = betas
    theta = param.detach().double().clone()
    m1, m2, nu = (torch.zeros_like(theta) for _ in range(3))
    for t, grad in enumerate(gradients, start=1):
        g = grad.double()
        alpha_t = min(t * alpha / t_alpha, alpha)
        fraction = t / t_beta3
        beta3_t = min(math.exp(math.log(beta1) * math.log(beta3)
                               / ((1 - fraction) * math.log(beta3) + fraction * math.log(beta1))), beta3)
        m1 = beta1 * m1 + (1 - beta1) * g
        m2 = beta3_t * m2 + (1 - beta3_t) * g
        nu = beta2 * nu + (1 - beta2) * g * g
        m1_hat, nu_hat = m1 / (1 - beta1**t), nu / (1 - beta2**t)
        theta = theta - lr * ((m1_hat + alpha_t * m2) / (nu_hat.sqrt() + eps) + weight_decay * theta)
    return theta


def test_ademamix_32bit_is_the_papers_update_with_the_warmups_as_long_as_the_run():
    """Red when set_run_length leaves a null warmup unset (bitsandbytes' None: full alpha and beta3 from step 1), or
    when the wrapper passes a setting on wrongly (t_alpha and t_beta3 swapped, alpha dropped)."""
    shapes, steps, run_length = [BIG, SMALL], 6, 4  # steps 1-4 inside the warmups, 5-6 past them
    params = _params(shapes)
    start = [p.detach().clone() for p in params]
    optimizer = _build("ademamix", params, lr=1e-2, alpha=8.0, betas=[0.9, 0.99, 0.999], weight_decay=0.1)
    assert type(optimizer) is AdEMAMix and optimizer.param_groups[0]["t_alpha"] is None
    set_run_length(optimizer, run_length)
    assert (optimizer.param_groups[0]["t_alpha"], optimizer.param_groups[0]["t_beta3"]) == (run_length, run_length)
    gradients = _gradients(0, shapes, steps)
    _run(optimizer, params, gradients)
    for i, param in enumerate(params):
        expected = _paper_ademamix(start[i], [g[i] for g in gradients], 1e-2, (0.9, 0.99, 0.999), 8.0, 1e-8, 0.1,
                                   run_length, run_length)
        assert optimizer.state[param]["state1"].dtype == torch.float32
        torch.testing.assert_close(param.detach().double(), expected, rtol=1e-5, atol=1e-6)

    # warmups of their own lengths, given in the config: each reaches the update through its own name
    params = _params([BIG])
    start = params[0].detach().clone()
    optimizer = _build("ademamix", params, lr=1e-2, alpha=8.0, t_alpha=2, t_beta3=5)
    _run(optimizer, params, gradients := _gradients(3, [BIG], steps))
    expected = _paper_ademamix(start, [g[0] for g in gradients], 1e-2, (0.9, 0.999, 0.9999), 8.0, 1e-8, 0.01, 2, 5)
    torch.testing.assert_close(params[0].detach().double(), expected, rtol=1e-5, atol=1e-6)


def test_ademamix8bit_holds_uint8_states_and_stays_near_the_32bit_update():
    """Red when the 8-bit option keeps float32 states (optim_bits not passed on, a silent 32-bit run), or when the
    small tensor's states are not float32 (min_8bit_size ignored)."""
    shapes, steps = [BIG, SMALL], 5
    gradients = _gradients(0, shapes, steps)
    runs = {}
    for option in ("ademamix", "ademamix8bit"):
        params = _params(shapes)
        optimizer = _build(option, params, lr=1e-3, t_alpha=steps, t_beta3=steps)
        _run(optimizer, params, gradients)
        runs[option] = (optimizer, params)
    eight, params8 = runs["ademamix8bit"]
    big, small = (eight.state[p] for p in params8)
    assert big["state1"].dtype == torch.uint8 and big["state2"].dtype == torch.uint8
    assert big["state1"].shape == (2, *BIG) and big["absmax1"].shape == (2, math.ceil(math.prod(BIG) / 256))
    assert small["state1"].dtype == torch.float32 and small["state2"].dtype == torch.float32
    start = _params(shapes)
    moved32 = [p.detach() - s for p, s in zip(runs["ademamix"][1], start)]
    moved8 = [p.detach() - s for p, s in zip(params8, start)]
    # the small tensor's states are float32 in both: the same update to rounding
    torch.testing.assert_close(moved8[1], moved32[1], rtol=1e-5, atol=1e-8)
    # the big tensor's moments pass through 8 bits each step: the update differs by a few percent of its size
    error = (moved8[0] - moved32[0]).norm() / moved32[0].norm()
    assert error < 0.05, f"8-bit AdEMAMix moved {error:.3f} of the 32-bit update away from it"
    assert error > 0, "the 8-bit states changed nothing: not quantized"


def test_lion8bit_is_lion_sign_update_with_decoupled_weight_decay():
    """Red when lion8bit.yaml's betas are swapped ([0.99, 0.9]) or its decay is not optimizer=lion's, and when the
    update is not lr x sign per element (the first step, whose momentum is zero, is exact)."""
    pytest.importorskip("lion_pytorch")
    shapes, steps, lr = [BIG, SMALL], 6, 1e-3
    gradients = _gradients(0, shapes, steps)
    params8, params_ref = _params(shapes), _params(shapes)
    start = [p.detach().clone() for p in params8]
    eight = _build("lion8bit", params8, lr=lr)
    reference = _build("lion", params_ref, lr=lr)  # lion-pytorch with optimizer=lion's betas and weight decay
    assert type(eight).__name__ == "Lion8bit"
    _run(eight, params8, gradients[:1])
    decay = eight.param_groups[0]["weight_decay"]
    for param, before, grad in zip(params8, start, gradients[0]):  # step 1: m = 0, so sign((1 - beta1) g)
        expected = before * (1 - lr * decay) - lr * grad.sign()
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-6)
    _run(reference, params_ref, gradients[:1])
    _run(eight, params8, gradients[1:])
    _run(reference, params_ref, gradients[1:])
    assert eight.state[params8[0]]["state1"].dtype == torch.uint8  # the momentum of the big tensor in 8 bits
    assert eight.state[params8[1]]["state1"].dtype == torch.float32
    for param, ref in zip(params8, params_ref):
        # each step moves each element by lr (sign) and the decay: an element whose sign flipped under the 8-bit
        # momentum differs by 2 lr per flipped step; few are near zero, so few flip
        differs = (param.detach() - ref.detach()).abs() > 1e-6
        assert differs.float().mean() < 0.02, f"{differs.float().mean():.3f} of the elements took another sign"
        assert (param.detach() - ref.detach()).abs().max() <= 2 * lr * (steps - 1) + 1e-6


def _check(option: str, *overrides: str) -> None:
    check_config(compose_config(f"optimizer={option}", *overrides, output_dir=ROOT / "outputs" / "unused"))


@pytest.mark.parametrize("option", ["ademamix", "ademamix8bit", "lion8bit"])
def test_the_options_pass_the_checks(option):
    _check(option)


@pytest.mark.parametrize(("override", "message"), [
    ("optimizer.betas=[0.9,0.999]", "optimizer.betas=[0.9, 0.999]: AdEMAMix takes three decay rates"),
    ("optimizer.betas=[0.9,0.999,0.5]", "beta3 (the slow momentum) is below beta1"),
    ("optimizer.betas=[0.9,0.999,1.0]", "optimizer.betas[2]=1.0 must be in [0, 1)"),
    ("optimizer.alpha=-1", "optimizer.alpha=-1: the slow momentum's weight must be a number >= 0"),
    ("optimizer.t_alpha=0", "optimizer.t_alpha=0: optimizer steps of the warmup, an integer >= 1, or null"),
    ("optimizer.optim_bits=4", "optimizer.optim_bits=4: bitsandbytes keeps AdEMAMix's states in 8 or 32 bits"),
    ("+optimizer.t_alpah=10", "optimizer.t_alpah"),
])
def test_ademamix_values_are_refused_before_loading(override, message):
    """Red when AdEMAMix.check_options is gone (bitsandbytes would take two betas and fail inside a step, or take
    beta3 < beta1 and a warmup of 0 steps, which divides by zero)."""
    with pytest.raises(UserError) as error:
        _check("ademamix", override)
    assert message in str(error.value)


@pytest.mark.parametrize("option", ["ademamix", "ademamix8bit"])
@pytest.mark.parametrize("hardware", ["fsdp", "zero2"])
def test_ademamix_under_a_sharding_strategy_is_refused_with_the_reason(option, hardware):
    """Red when AdEMAMix.whole_matrices is gone: under fsdp the run would load and raise at the first step inside
    bitsandbytes' kernel; under zero the 8-bit blocks would span ZeRO's flat partitions, another quantization."""
    with pytest.raises(UserError) as error:
        _check(option, f"hardware={hardware}")
    assert "runs bitsandbytes' kernels on whole plain tensors" in str(error.value)
    assert f"hardware={hardware}" in str(error.value)

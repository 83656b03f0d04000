"""model.attn_implementation=auto: transformers' sdpa with torch's math kernel where it measured faster."""

import json
from unittest import mock

import torch

from rlhf.embedded.tiny_model import TinySpec
from rlhf.models import attention
from rlhf.models.loading import load_policy
from rlhf.telemetry.memory_preflight import activation_bytes


def _tiny(**kwargs):
    return load_policy(tiny=TinySpec(warm_start_steps=0), **kwargs)


def _kernels_used(model, ids, autocast: bool, grad: bool) -> list[bool]:
    """uses_math_kernel's answer at every attention call of one forward."""
    answers: list[bool] = []
    real = attention.uses_math_kernel

    def spy(query, key, value):
        answers.append(real(query, key, value))
        return answers[-1]

    with mock.patch.object(attention, "uses_math_kernel", side_effect=spy), torch.set_grad_enabled(grad), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=ids)
    return answers


def test_auto_is_the_default_and_other_values_are_kept(tmp_path):
    policy = _tiny()
    assert policy.model.config._attn_implementation == attention.NAME
    policy.model.save_pretrained(tmp_path)
    policy.tokenizer.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert attention.NAME not in json.dumps(saved)  # a saved model loads anywhere, without rlhf
    assert load_policy(str(tmp_path)).model.config._attn_implementation == attention.NAME
    assert load_policy(str(tmp_path), attn_implementation=None).model.config._attn_implementation == "sdpa"
    assert load_policy(str(tmp_path), attn_implementation="eager").model.config._attn_implementation == "eager"
    assert _tiny(attn_implementation="eager").model.config._attn_implementation == "eager"


def test_math_kernel_only_for_a_bf16_training_forward_on_a_cpu_below_the_threshold():
    model = _tiny().model
    layers = model.config.num_hidden_layers
    short = torch.randint(3, 200, (2, attention.CPU_MATH_BELOW_KEYS - 1))
    long = torch.randint(3, 200, (2, attention.CPU_MATH_BELOW_KEYS))
    assert _kernels_used(model, short, autocast=True, grad=True) == [True] * layers
    assert _kernels_used(model, long, autocast=True, grad=True) == [False] * layers
    assert _kernels_used(model, short, autocast=True, grad=False) == [False] * layers  # a frozen forward: flash
    assert _kernels_used(model, short, autocast=False, grad=True) == [False] * layers  # float32: flash
    frozen = _tiny().model.requires_grad_(False)  # a reference under grad mode computes no gradient either
    assert _kernels_used(frozen, short, autocast=True, grad=True) == [False] * layers


def test_the_math_kernel_computes_what_sdpa_computes():
    """The same logits and gradients as plain sdpa up to bf16 rounding (float32: the same kernel, bit for bit)."""
    torch.manual_seed(0)
    auto, plain = _tiny(), _tiny(attn_implementation="sdpa")
    plain.model.load_state_dict(auto.model.state_dict())
    ids = torch.randint(3, 200, (3, 40))
    mask = torch.ones_like(ids)
    mask[0, 30:] = 0  # right padding, as the collators pad
    for autocast, tolerance in ((False, 0.0), (True, 0.05)):
        grads = []
        for policy in (auto, plain):
            policy.model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = policy.model(input_ids=ids, attention_mask=mask).logits.float()
            logits[mask.bool()].logsumexp(-1).sum().backward()
            grads.append((logits.detach(), policy.model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
        (a, ga), (b, gb) = grads
        assert torch.isfinite(a).all() and torch.isfinite(ga).all()
        assert (a - b).abs().max().item() <= tolerance
        assert (ga - gb).abs().max().item() <= tolerance * max(1.0, gb.abs().max().item())
        assert torch.equal(a, b) != autocast  # under bf16 two kernels ran (they round differently), else one


def test_the_memory_estimate_counts_what_the_math_kernel_keeps():
    config = _tiny().model.config
    short = attention.CPU_MATH_BELOW_KEYS - 1
    kept = attention.kept_bytes(config, short, "cpu", bf16=True)
    assert kept == 3 * config.hidden_size * 2 + config.num_attention_heads * short * 4
    assert attention.kept_bytes(config, attention.CPU_MATH_BELOW_KEYS, "cpu", bf16=True) is None
    assert attention.kept_bytes(config, short, "cpu", bf16=False) is None
    assert attention.kept_bytes(config, short, "cuda", bf16=True) is None
    with_math = activation_bytes(config, 8, short, 2, False, attention_bytes=kept)
    assert with_math - activation_bytes(config, 8, short, 2, False) == 8 * short * config.num_hidden_layers * kept


def test_the_estimate_is_close_to_what_autograd_keeps_under_the_math_kernel():
    from tests.telemetry.test_memory_preflight import _saved_bytes

    model = _tiny().model.train()
    sequences, tokens = 16, 48
    ids = torch.randint(3, 200, (sequences, tokens))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": torch.ones_like(ids)}
    kept = {}
    for name in ("sdpa", attention.NAME):  # auto last: the config the estimate reads
        model.set_attn_implementation(name)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kept[name] = _saved_bytes(model, batch)
    more = kept[attention.NAME] - kept["sdpa"]  # what the math kernel keeps beyond flash
    assert more > 0
    estimate = activation_bytes(model.config, sequences, tokens, 2, False,
                                attention_bytes=attention.kept_bytes(model.config, tokens, "cpu", True))
    assert 0.67 * kept[attention.NAME] < estimate < 1.5 * kept[attention.NAME], (estimate, kept)
    added = estimate - activation_bytes(model.config, sequences, tokens, 2, False)
    assert 0.67 * more < added < 1.5 * more, (added, more)


def test_flex_attention_where_torch_cannot_train_through_it_is_refused_before_loading(monkeypatch):
    """``model.attn_implementation=flex_attention`` on a CPU, whose torch has no flex backward pass, is refused by the
    config check (before the run folder or any model), naming torch's reason and the attention that works there; the
    answer is torch's own (a torch that could train through it passes); sdpa and eager pass (red: the check left out,
    the run ending in torch's NotImplementedError at its first backward pass)."""
    import pytest

    from rlhf.config.checks import check_config
    from rlhf.core.errors import UserError
    from tests.conftest import compose_config

    reason = attention.flex_backward_fails("cpu")
    assert reason is not None and "backward" in reason, reason
    flex = ("algo=dpo", "hardware=cpu", "model.attn_implementation=flex_attention")
    with pytest.raises(UserError, match=r"model.attn_implementation=flex_attention: torch .* cannot train through flex "
                                        r"attention on the cpu .*NotImplementedError.* Fix: "
                                        r"model.attn_implementation=auto \(sdpa\) or eager; the shared prompt"):
        check_config(compose_config(*flex))
    for other in ("sdpa", "eager"):
        check_config(compose_config("algo=dpo", "hardware=cpu", f"model.attn_implementation={other}"))
    monkeypatch.setattr(attention, "flex_backward_fails", lambda device_type: None)  # a torch that trains through it
    check_config(compose_config(*flex))

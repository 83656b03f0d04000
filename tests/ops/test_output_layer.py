import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from rlhf.algos.dpo import DPO
from rlhf.algos.kto import KTO
from rlhf.algos.sft import SFT
from rlhf.core.errors import UserError
from rlhf.data.collate import collate_sequences
from rlhf.embedded.tiny_model import TinySpec
from rlhf.ops.completion_logps import SCORED_ROWS, SCORED_ROWS_WIDTH, completion_stats, keep_completion_logits
from rlhf.ops.linear_logps_torch import LinearLogSoftmaxTorch
from rlhf.ops.output_layer import FusedOutputLayer, check_when, tap_output_layer, token_request


def _model(**config) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=32, tie_word_embeddings=False, **config))


def _batch():
    torch.manual_seed(1)
    ids = [torch.randint(1, 50, (n,)).tolist() for n in (7, 5, 9)]
    masks = [[0] * 3 + [1] * 4, [0] * 4 + [1], [0] * 2 + [1] * 7]
    return keep_completion_logits(collate_sequences(ids, masks, 0))


def _stats_and_grads(model, batch):
    model.zero_grad()
    stats = completion_stats(model, batch)
    # every_token_logps: every kept position's, or (with scored rows) the completion's only
    every = stats.every_token_logps if SCORED_ROWS not in batch else stats.every_token_logps * stats.mask
    (stats.token_logps.sum() + 0.5 * every.sum()).backward()
    return stats, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("scored_rows", [True, False], ids=["scored-rows", "kept-window"])
def test_a_tapped_output_layer_answers_with_the_log_probabilities_the_logits_give(monkeypatch, scored_rows):
    """completion_stats on a tapped model: the same statistics and gradients as from the logits, and the output
    layer returned [B, L] log-probabilities, never [B, T, V] logits. With the batch's scored rows
    (keep_completion_logits), it computed those rows only: the completion tokens, no prompt or padding position."""
    plain, tapped = _model(), _model()
    assert tap_output_layer(tapped, True) and type(tapped.lm_head) is FusedOutputLayer
    shapes, computed = [], []
    tapped.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    apply = LinearLogSoftmaxTorch.apply
    monkeypatch.setattr(LinearLogSoftmaxTorch, "apply", lambda h, *a: computed.append(h.shape[0]) or apply(h, *a))
    batch = _batch()
    if not scored_rows:
        batch = {k: v for k, v in batch.items() if k not in (SCORED_ROWS, SCORED_ROWS_WIDTH)}
    (want, want_grads), (got, got_grads) = _stats_and_grads(plain, batch), _stats_and_grads(tapped, batch)
    keep = int(batch["logits_to_keep"])
    assert shapes == [(3, keep - 1)]  # one log-probability per kept position
    assert computed == [int(want.mask.sum()) if scored_rows else 3 * (keep - 1)]  # 12 rows, or the window's 21
    every = (lambda s: s.every_token_logps * s.mask) if scored_rows else (lambda s: s.every_token_logps)
    torch.testing.assert_close(every(got), every(want), atol=1e-6, rtol=1e-5)
    for field in ("logps", "token_logps"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), atol=1e-6, rtol=1e-5)
    for field in ("num_tokens", "greedy_match", "mask"):
        assert torch.equal(getattr(got, field), getattr(want, field))
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5)


def test_scored_rows_survive_padding_the_batch_to_a_longer_length():
    """A compiled run pads a collated batch to a bucket's length (pad_to_multiple): the scored rows still name the
    completion positions, and a tapped layer gives the statistics of the unpadded batch."""
    from rlhf.data.collate import pad_to_multiple

    tapped = _model()
    tap_output_layer(tapped, True)
    batch = _batch()
    padded = pad_to_multiple(batch, 16)
    assert padded["input_ids"].shape[1] == 16 and torch.equal(padded[SCORED_ROWS], batch[SCORED_ROWS])
    want, got = completion_stats(_model(), batch), completion_stats(tapped, padded)
    torch.testing.assert_close(got.logps, want.logps, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.token_logps[:, :8], want.token_logps, atol=1e-6, rtol=1e-5)
    assert torch.equal(got.greedy_match, want.greedy_match) and torch.equal(got.num_tokens, want.num_tokens)


def test_without_a_request_or_on_a_cpu_under_auto_the_layer_computes_logits():
    """generate() and every other forward see the plain layer; `auto` answers on a GPU only."""
    plain, tapped, auto = _model(), _model(), _model()
    tap_output_layer(tapped, True)
    assert tap_output_layer(auto, "auto")
    prompt = torch.tensor([[5, 6, 7]])
    assert torch.equal(tapped.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0),
                       plain.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0))
    with token_request(torch.tensor([[6, 7]]), with_argmax=True) as request:
        logits = auto(prompt).logits
    assert request.logps is None and logits.shape == (1, 3, 50)  # a CPU: the caller does the log-softmax


def test_the_tap_keeps_parameters_and_checkpoints_and_survives_a_copy(tmp_path):
    model = _model()
    keys = set(model.state_dict())
    tap_output_layer(model, True)
    assert set(model.state_dict()) == keys
    twin = copy.deepcopy(model)  # as algo/reference=copy makes the reference
    assert type(twin.lm_head) is FusedOutputLayer and twin.lm_head.fused is True
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded.lm_head) is torch.nn.Linear  # a saved model is a plain transformers model
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_models_whose_logits_are_transformed_or_whose_output_layer_is_wrapped_are_not_tapped():
    assert not tap_output_layer(_model(), False)
    capped = _model()
    capped.config.final_logit_softcapping = 30.0  # as Gemma 2 has: logits change after the output layer
    assert not tap_output_layer(capped) and type(capped.lm_head) is torch.nn.Linear
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(_model(), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    assert not tap_output_layer(wrapped, True)
    lora_elsewhere = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    assert tap_output_layer(lora_elsewhere, True)  # the output layer itself is plain (and frozen)
    batch = _batch()
    stats = completion_stats(lora_elsewhere, batch)
    stats.logps.sum().backward()
    assert lora_elsewhere.base_model.model.lm_head.weight.grad is None


def test_a_transform_after_the_output_layer_is_a_clear_error():
    """A model (not known to transform its logits) whose forward changes what the layer returned: refused, with
    the fix, rather than log-probabilities that are not its own."""
    model = _model()
    tap_output_layer(model, True)
    forward = model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled
    with pytest.raises(UserError, match="algo.fused_output_layer=false"):
        completion_stats(model, _batch())


@pytest.mark.parametrize("value", ["yes", 1, 0.0, None])
def test_bad_values_are_refused_with_the_choices(value):
    with pytest.raises(UserError, match="auto, true, false, triton"):
        check_when(value)
    with pytest.raises(UserError, match="algo.fused_output_layer"):
        DPO(fused_output_layer=value)
    with pytest.raises(UserError, match="algo.fused_output_layer"):
        SFT(fused_output_layer=value)
    with pytest.raises(UserError, match="algo.fused_output_layer"):
        KTO(fused_output_layer=value)


@pytest.mark.parametrize("cls", [SFT, DPO, KTO])
def test_each_log_likelihood_algorithm_taps_its_policy_and_the_reference_copy_as_told(cls):
    for fused in (True, "auto", False):
        policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
        algo = cls(fused_output_layer=fused)
        algo.setup(policy.model, policy.tokenizer)
        models = [policy.model, *algo.frozen.values()]
        assert len(models) == (1 if cls is SFT else 2)
        for model in models:
            layer = model.get_output_embeddings()
            assert (type(layer) is FusedOutputLayer) == (fused is not False)
            assert getattr(layer, "fused", fused) == fused


def test_a_model_that_ignores_logits_to_keep_is_answered_with_logits_at_the_right_positions():
    """The layer answers only for the positions asked for; a model that computed the output layer at every position
    despite logits_to_keep gets logits, and completion_stats aligns them by their own length."""
    plain, tapped = _model(), _model()
    tap_output_layer(tapped, True)
    forward = tapped.forward

    def ignores_keep(*args, logits_to_keep=0, **kwargs):
        return forward(*args, **kwargs)

    tapped.forward = ignores_keep
    batch = _batch()
    want, got = completion_stats(plain, batch), completion_stats(tapped, batch)
    torch.testing.assert_close(got.token_logps, want.token_logps, atol=1e-6, rtol=1e-5)  # completion positions
    kept = batch["input_ids"].shape[1] - int(batch["logits_to_keep"])
    assert not want.every_token_logps[:, :kept].any() and got.every_token_logps[:, :kept].all()  # logits there too
    assert torch.equal(got.greedy_match, want.greedy_match) and torch.equal(got.mask, want.mask)


def test_a_reference_loaded_on_its_own_is_tapped_as_the_policy(tmp_path):
    """algo/reference=model: a model of its own, not a copy of the tapped policy; it answers as the policy does."""
    from rlhf.models.reference import Pretrained

    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    policy.model.save_pretrained(tmp_path)
    policy.tokenizer.save_pretrained(tmp_path)
    algo = DPO(reference=Pretrained(str(tmp_path)), fused_output_layer=True)
    algo.setup(policy.model, policy.tokenizer)
    reference = algo.frozen["reference"]
    assert reference is not policy.model and type(reference.get_output_embeddings()) is FusedOutputLayer


def test_triton_is_asked_for_by_name_and_answers_with_torch_operations_off_a_gpu(monkeypatch):
    """``triton`` opts into the Triton kernel on a GPU (auto picks it only once a GPU measured it); on a CPU the
    layer answers as ``true`` does, with torch operations, and on a GPU without the package the run ends in one
    message naming the fix."""
    assert check_when("triton") == "triton"
    with pytest.raises(UserError, match="algo.shared_prompt='triton' is not one of auto, true, false. Fix"):
        DPO(shared_prompt="triton")  # the output layer's value only
    layer = FusedOutputLayer(4, 8)
    layer.fused = "triton"
    assert layer.answers_on(torch.device("cpu")) and not layer.kernel_on(torch.device("cpu"))
    assert layer.kernel_on(torch.device("cuda"))
    layer.fused = "auto"
    assert not layer.kernel_on(torch.device("cuda"))  # auto on a GPU: torch operations (rlhf/core/auto_choices.py)
    tapped = _model()
    assert tap_output_layer(tapped, "triton")
    computed = []
    apply = LinearLogSoftmaxTorch.apply
    monkeypatch.setattr(LinearLogSoftmaxTorch, "apply", lambda h, *a: computed.append(h.shape[0]) or apply(h, *a))
    got, _ = _stats_and_grads(tapped, _batch())
    assert computed  # answered, with torch operations
    want, _ = _stats_and_grads(_model(), _batch())
    torch.testing.assert_close(got.logps, want.logps, atol=1e-6, rtol=1e-5)
    monkeypatch.setattr(FusedOutputLayer, "kernel_on", lambda self, device: True)
    monkeypatch.setattr("rlhf.ops.output_layer.triton_kernel", lambda: None)
    with pytest.raises(UserError, match="pip install triton"):
        _stats_and_grads(tapped, _batch())

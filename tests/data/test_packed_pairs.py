"""Pairs packed into one row around their prompts (rlhf.data.shared_prompt.collate_packed) under one attention mask
a batch (rlhf.data.layout_masks): the statistics, DPO's loss and every gradient of two plain sequences a pair."""

import copy

import pytest
import torch
import torch.nn.attention.flex_attention as flex
import transformers.integrations.flex_attention as transformers_flex

from rlhf.algos.dpo import DPO
from rlhf.algos.sft import SFT
from rlhf.core.errors import UserError
from rlhf.data import layout_masks, shared_prompt
from rlhf.data.collate import PACKED_ROWS, SEGMENT_IDS
from rlhf.embedded.tiny_model import TinySpec
from rlhf.models.reference import FrozenCopy
from rlhf.ops.completion_logps import completion_stats
from tests.data.test_shared_prompt import ROWS, TOKENIZER, _model
from tests.independent_logps import answer_logps


@pytest.fixture
def eager_flex(monkeypatch):
    """Flex attention with a backward pass on a CPU: torch refuses one there (its compiled kernels have none), so
    transformers' compiled call is replaced by flex attention's eager implementation (every score computed, the
    mask's rule applied to each), whose backward pass does run on a CPU. The block structure itself is checked by
    the compiled forward passes (no gradient) below."""
    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(transformers_flex, "compile_friendly_flex_attention",
                        lambda query, key, value, training=False, **options: flex.flex_attention(query, key, value,
                                                                                                 **options))


def _tiny(attention: str) -> torch.nn.Module:
    """The embedded tiny model (a Llama), small, under ``attention``."""
    model = TinySpec(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, warm_start_steps=0).build().model
    model.set_attn_implementation(attention)
    return model


def _dpo_step(model: torch.nn.Module, **options):
    """DPO's loss, the policy's log-probabilities and every parameter's gradient on ROWS (pairs of different lengths,
    one without a prompt), the policy moved away from its reference copy; the algorithm and its batch."""
    policy = copy.deepcopy(model).train()
    algo = DPO(beta=0.5, reference=FrozenCopy(), fused_output_layer=False, **options)
    algo.setup(policy, TOKENIZER)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    batch = algo.collate([algo.tokenize(r, TOKENIZER) for r in ROWS])
    loss, metrics = algo.loss(policy, batch)
    loss.backward()
    logps = completion_stats(policy, batch).logps.detach()
    return float(loss.detach()), logps, [p.grad for p in policy.parameters()], algo, batch, policy


def test_pairs_pack_into_one_row_of_their_tokens_and_no_pair_sees_another():
    ids = [[5, 6, 7, 1], [8, 1]]  # a prompt of 2 tokens then "7"; no prompt then "8"
    masks = [[0, 0, 1, 1], [1, 1]]
    batch = shared_prompt.collate_packed(ids, masks, [[5, 6, 9, 9, 1], [3, 1]], [[0, 0, 1, 1, 1], [1, 1]])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1, 6, 9, 9, 1, 8, 1, 3, 1]]
    assert batch["branch_ids"].tolist() == [[0, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 1, 2, 3, 4, 0, 1, 0, 1]]
    assert batch["pair_ids"].tolist() == [[0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]]
    assert batch[SEGMENT_IDS].tolist() == [[0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 3, 3]]  # chosen 0, 1; rejected 2, 3
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1]]
    assert batch[PACKED_ROWS] == 4 and shared_prompt.scored_sequences(batch) == 4
    sees = layout_masks.model_inputs(batch, _model())["attention_mask"][0, 0].int().tolist()
    assert sees[5] == [1, 0, 0, 0, 1, 1] + [0] * 6  # rejected's first answer token: the prefix, its branch
    assert sees[9] == [0] * 8 + [1, 1, 0, 0]  # the second pair's chosen: nothing of the first pair
    assert sees[11] == [0] * 10 + [1, 1]  # its rejected: its own branch only (no prefix without a prompt)


@pytest.mark.parametrize("family", ["embedded", "qwen2", "gpt_neox"])
def test_packed_pairs_under_flex_attention_give_two_sequences_dpo_loss_and_gradients(family, eager_flex):
    """DPO on the pairs packed into one row under flex attention's block mask, against two plain sequences a pair
    under sdpa: the same loss and every gradient, and log-probabilities that the model alone gives each answer."""
    model = _tiny("sdpa") if family == "embedded" else _model(family)
    plain = _dpo_step(model, shared_prompt=False)
    flexed = copy.deepcopy(model)
    flexed.set_attn_implementation("flex_attention")
    packed = _dpo_step(flexed)
    algo, batch = packed[3], packed[4]
    assert algo.shares_prompt and algo.packs and batch["input_ids"].shape[0] == 1
    assert batch["input_ids"].shape[1] < plain[4]["input_ids"].numel()  # no padding, each prompt once
    assert packed[0] == pytest.approx(plain[0], abs=1e-6)
    torch.testing.assert_close(packed[1], plain[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(plain[2], packed[2], strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    alone = copy.deepcopy(packed[5])  # the trained policy, each answer in a sequence of its own (sdpa)
    alone.set_attn_implementation("sdpa")
    prompted = [r for r in ROWS if r["prompt"]]  # (the helper scores an answer after a prompt)
    expected = [answer_logps(alone, TOKENIZER, [r["prompt"] for r in prompted], [r[side] for r in prompted])
                for side in ("chosen", "rejected")]
    got = [packed[1][i + side * len(ROWS)].item() for side in (0, 1) for i, r in enumerate(ROWS) if r["prompt"]]
    assert got == pytest.approx(expected[0] + expected[1], abs=1e-4)


def test_the_compiled_block_mask_gives_the_two_sequences_statistics():
    """transformers' own call (compiled flex attention, which skips the blocks no query sees): forward only, as a
    CPU computes it (no backward pass there); a mask ignored or wrong in its blocks would mix pairs and branches."""
    model = _tiny("flex_attention").eval()
    plain, packed = DPO(shared_prompt=False), DPO(shared_prompt=True)
    packed.packs = True
    rows = [plain.tokenize(r, TOKENIZER) for r in ROWS]
    with torch.no_grad():
        x, y = completion_stats(model, plain.collate(rows)), completion_stats(model, packed.collate(rows))
    assert torch.allclose(x.logps, y.logps, atol=1e-4) and x.logps.abs().min() > 1
    assert torch.equal(x.num_tokens, y.num_tokens) and torch.equal(x.greedy_match, y.greedy_match)


def test_one_mask_a_batch_is_built_and_shared_by_policy_and_reference(eager_flex, monkeypatch):
    built = []
    block_mask = layout_masks.block_mask
    monkeypatch.setattr(layout_masks, "block_mask", lambda *args: built.append(block_mask(*args)) or built[-1])
    seen = []
    _, _, _, algo, batch, policy = _dpo_step(_tiny("flex_attention"))  # the policy's forward pass and the reference's
    assert len(built) == 1 and isinstance(built[0], flex.BlockMask)
    reference = algo.frozen["reference"]
    reference.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["attention_mask"]),
                                        with_kwargs=True)
    with torch.no_grad():
        algo.reference_logps(batch, policy)
    assert len(built) == 1 and seen == [built[0]]  # the reference got the policy's mask, not a new one


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padding_free_pairs_share_their_prompts_under_a_dense_mask_on_a_cpu(attention):
    """padding_free with shared_prompt=auto on a CPU: the pairs packed around their prompts, under the dense mask
    of the packed row (sdpa: boolean; eager: additive), give the loss and gradients of two plain sequences a pair."""
    model = _tiny(attention)
    plain = _dpo_step(model, shared_prompt=False)
    packed = _dpo_step(model, padding_free=True)
    assert packed[3].shares_prompt and packed[3].packs and packed[4]["input_ids"].shape[0] == 1
    assert packed[0] == pytest.approx(plain[0], abs=1e-6)
    for a, b in zip(plain[2], packed[2], strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_padding_free_sequences_under_flex_attention_get_a_block_mask_of_their_rows(eager_flex):
    model = _tiny("sdpa")
    plain = _dpo_step(model, shared_prompt=False)
    flexed = copy.deepcopy(model)
    flexed.set_attn_implementation("flex_attention")
    packed = _dpo_step(flexed, shared_prompt=False, padding_free=True)
    assert isinstance(packed[4][layout_masks.MASKS][("block", "cpu")], flex.BlockMask)
    assert packed[0] == pytest.approx(plain[0], abs=1e-6)
    for a, b in zip(plain[2], packed[2], strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_padding_free_on_a_gpu_switches_sdpa_to_flex_attention_or_refuses(monkeypatch):
    """Under sdpa a packed row's sequences are kept apart by a mask of the packed length squared: on a GPU a model
    that supports flex attention is switched to it (policy and reference), one that does not is refused."""
    llama, gpt2 = _tiny("sdpa"), _model("gpt2")
    assert layout_masks.attention_for_packing(llama, on_gpu=True) == "flex_attention"
    assert layout_masks.attention_for_packing(llama, on_gpu=False) is None  # no flex backward pass on a CPU
    with pytest.raises(UserError, match=r"padding_free=true on a GPU: this model \(gpt2\) runs sdpa.*"
                                        r"Fix: model.attn_implementation=flash_attention_2.*algo.padding_free=false"):
        layout_masks.attention_for_packing(gpt2, on_gpu=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU
    from accelerate.state import PartialState

    monkeypatch.setattr(PartialState, "_shared_state", {})  # no run started: the machine's GPU decides
    assert layout_masks.computes_on_gpu()
    algo = DPO(padding_free=True)
    algo.setup(llama, TOKENIZER)
    assert [shared_prompt.attention_of(m) for m in (llama, algo.frozen["reference"])] == ["flex_attention"] * 2
    assert algo.packs and algo.shares_prompt
    with pytest.raises(UserError, match=r"this model \(gpt2\)"):
        DPO(padding_free=True).setup(gpt2, TOKENIZER)
    sft_model = _tiny("sdpa")
    SFT(padding_free=True).setup(sft_model, TOKENIZER)  # SFT's packed rows: the same switch
    assert shared_prompt.attention_of(sft_model) == "flex_attention"
    with pytest.raises(UserError, match=r"this model \(gpt2\)"):
        SFT(padding_free=True).setup(_model("gpt2"), TOKENIZER)


def test_a_run_on_the_cpu_of_a_machine_with_a_gpu_keeps_its_attention(monkeypatch):
    """hardware=cpu on a machine with a GPU computes on the CPU, where flex attention has no backward pass: the
    strategy's device decides, not the machine's GPU."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(PartialState, "_shared_state", {})
    monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    Accelerator(cpu=True)
    assert not layout_masks.computes_on_gpu()
    model = _tiny("sdpa")
    SFT(padding_free=True).setup(model, TOKENIZER)
    assert shared_prompt.attention_of(model) == "sdpa"

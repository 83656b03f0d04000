"""algo.shared_prompt: a preference pair as one sequence around its prompt computes what its two sequences do."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlhf.algos.dpo import DPO
from rlhf.core.errors import UserError
from rlhf.data import layout_masks, shared_prompt
from rlhf.models import attention
from rlhf.models.reference import NoReference
from rlhf.models.tokenizer import byte_tokenizer
from rlhf.ops.completion_logps import completion_stats, keep_completion_logits
from rlhf.ops.output_layer import tap_output_layer

TOKENIZER = byte_tokenizer()
# Unequal prompts and answers (padding in both layouts), one without a prompt.
ROWS = [{"prompt": "abc=", "chosen": "cba", "rejected": "cabxx"},
        {"prompt": "hello there=", "chosen": "olleh", "rejected": "hel"},
        {"prompt": "", "chosen": "xyz", "rejected": "ab"}]
SMALL = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
FAMILY_CONFIG = {  # each checked family, small, from its config class
    "llama": SMALL, "mistral": {**SMALL, "sliding_window": None}, "qwen2": SMALL, "qwen3": {**SMALL, "head_dim": 8},
    "gemma": {**SMALL, "head_dim": 8}, "phi3": {**SMALL, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
    "gpt2": {"vocab_size": 300, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "gpt_neox": {**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}},
}


def _model(family: str = "llama", attn: str = "sdpa", **config) -> torch.nn.Module:
    torch.manual_seed(0)
    made = AutoConfig.for_model(family, **{**FAMILY_CONFIG[family], **config})
    return AutoModelForCausalLM.from_config(made, attn_implementation=attn).eval()


def _batches(model, rows=ROWS):
    plain, shared = DPO(shared_prompt=False), DPO(shared_prompt=True)
    for algo in (plain, shared):
        algo.pad_id = TOKENIZER.pad_token_id
    tokenized = [plain.tokenize(r, TOKENIZER) for r in rows]
    return plain.collate(tokenized), shared.collate(tokenized)


def test_the_layout_repeats_the_prompts_last_token_and_restarts_positions_there():
    algo = DPO(shared_prompt=True)
    algo.pad_id = TOKENIZER.pad_token_id
    batch = algo.collate([algo.tokenize({"prompt": "ab=", "chosen": "x", "rejected": "yz"}, TOKENIZER),
                          algo.tokenize({"prompt": "", "chosen": "q", "rejected": "r"}, TOKENIZER)])
    eos, pad = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
    assert batch["input_ids"].tolist() == [[*b"ab=x", eos, ord("="), *b"yz", eos],
                                           [ord("q"), eos, ord("r"), eos, pad, pad, pad, pad, pad]]
    assert batch["branch_ids"].tolist() == [[0, 0, 1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, -1, -1, -1, -1, -1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 4, 5], [0, 1, 0, 1, 0, 0, 0, 0, 0]]
    # The prompt's last token in each branch is never scored; without a prompt a branch's first token is not either
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 1, 1, 1], [0, 1, 0, 1, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 9, [1] * 4 + [0] * 5]
    assert algo.samples(batch) == 2 and shared_prompt.scored_sequences(batch) == 4
    mask = layout_masks.model_inputs(batch, _model())["attention_mask"][0, 0]
    sees = [[int(v) for v in row] for row in mask]
    assert sees[6] == [1, 1, 0, 0, 0, 1, 1, 0, 0]  # rejected's 'y': the prefix 'ab', its branch's '=', itself
    assert sees[3] == [1, 1, 1, 1, 0, 0, 0, 0, 0]  # chosen's 'x': the prefix and its branch
    padding = layout_masks.model_inputs(batch, _model())["attention_mask"][1, 0, 6]
    assert padding.tolist() == [False] * 6 + [True] + [False] * 2  # padding sees itself only: no empty row


@pytest.mark.parametrize("family", shared_prompt.CHECKED_FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_checked_family_gives_the_two_sequences_statistics(family, attn):
    """What CHECKED_FAMILIES promises: a family that ignored position ids or the custom mask would differ here."""
    model = _model(family, attn)
    assert shared_prompt.unsupported(model, 1024) is None
    plain, shared = _batches(model)
    assert shared["input_ids"].numel() < plain["input_ids"].numel()
    with torch.no_grad():
        x, y = completion_stats(model, plain), completion_stats(model, shared)
    assert torch.allclose(x.logps, y.logps, atol=1e-4) and x.logps.abs().min() > 1
    assert torch.equal(x.num_tokens, y.num_tokens) and torch.equal(x.greedy_match, y.greedy_match)
    # per token, aligned to each sequence's end (the layouts place tokens at different columns)
    for row in range(len(x.logps)):
        a, b = x.token_logps[row][x.mask[row]], y.token_logps[row][y.mask[row]]
        assert torch.allclose(a, b, atol=1e-4)


def test_under_flex_attention_the_layout_is_a_block_mask_with_the_two_sequences_statistics():
    """model.attn_implementation=flex_attention: the layout goes to the model as a BlockMask (blocks nobody sees are
    skipped), and the forward pass gives the plain batch's statistics (flex attention has no backward pass on a CPU:
    the gradients are checked on a GPU by benchmarks/gpu_check)."""
    from torch.nn.attention.flex_attention import BlockMask

    model = _model("llama", "flex_attention")
    assert shared_prompt.unsupported(model, 1024) is None
    plain, shared = _batches(model)
    assert isinstance(layout_masks.model_inputs(shared, model)["attention_mask"], BlockMask)
    with torch.no_grad():
        x, y = completion_stats(model, plain), completion_stats(model, shared)
    assert torch.allclose(x.logps, y.logps, atol=1e-4) and x.logps.abs().min() > 1
    assert torch.equal(x.num_tokens, y.num_tokens) and torch.equal(x.greedy_match, y.greedy_match)


def test_gradients_logits_kept_fused_output_layer_and_bf16_agree_with_two_sequences():
    model = _model()
    plain, shared = _batches(model)

    def loss_and_grads(model, batch):
        model.zero_grad()
        stats = completion_stats(model, batch)
        (stats.logps.sum() + stats.token_logps.pow(2).sum()).backward()
        return stats.logps.detach(), [p.grad.clone() for p in model.parameters()]

    (a, grads_a), (b, grads_b) = loss_and_grads(model, plain), loss_and_grads(model, shared)
    assert torch.allclose(a, b, atol=1e-4)
    assert all(torch.allclose(g, h, atol=1e-5, rtol=1e-4) for g, h in zip(grads_a, grads_b, strict=True))
    tapped = copy.deepcopy(model)
    assert tap_output_layer(tapped, True)
    for variant, batch in ((model, keep_completion_logits(shared)), (tapped, keep_completion_logits(shared))):
        with torch.no_grad():
            assert torch.allclose(completion_stats(variant, batch).logps, a, atol=1e-4)
    model.set_attn_implementation(attention.NAME)  # the math kernel under bf16 training
    assert shared_prompt.unsupported(model, 1024) is None  # MASKED_ATTENTION names ours
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c, d = completion_stats(model, plain).logps, completion_stats(model, shared).logps
    assert torch.allclose(c.float(), d.float(), atol=0.05 * a.abs().max())


def test_eager_gets_an_additive_mask_through_a_strategys_wrapper():
    """eager adds the mask to its scores: a boolean one would be wrong, also where DDP or DeepSpeed wrap the model."""

    class Wrapped(torch.nn.Module):  # as DDP and DeepSpeed hold the model: under .module (DeepSpeed: a config dict)
        def __init__(self, module):
            super().__init__()
            self.module, self.config = module, {"zero_optimization": {"stage": 3}}

    eager, sdpa = _model(attn="eager"), _model()
    _, batch = _batches(eager)
    for model in (eager, Wrapped(eager), Wrapped(Wrapped(eager))):
        mask = layout_masks.model_inputs(batch, model)["attention_mask"]
        assert mask.dtype == torch.float32 and mask.max() == 0 and mask.min() == torch.finfo(torch.float32).min
    assert layout_masks.model_inputs(batch, Wrapped(sdpa))["attention_mask"].dtype == torch.bool


def test_dpo_shares_prompts_where_the_model_can_and_says_why_not_where_it_cannot():
    llama = _model()
    algo = DPO(reference=NoReference())
    algo.setup(llama, TOKENIZER)
    assert algo.shares_prompt and "branch_ids" in algo.collate([algo.tokenize(ROWS[0], TOKENIZER)])
    assert algo.reference.logps(algo.collate([algo.tokenize(ROWS[0], TOKENIZER)]), None, llama).shape == (2,)
    opt = AutoModelForCausalLM.from_config(AutoConfig.for_model("opt", vocab_size=300, hidden_size=16,
                                                                ffn_dim=32, num_hidden_layers=1,
                                                                num_attention_heads=2, word_embed_proj_dim=16))
    assert "family 'opt'" in shared_prompt.unsupported(opt, 1024)
    auto = DPO(reference=NoReference())
    auto.setup(opt, TOKENIZER)
    assert not auto.shares_prompt and auto.collate([auto.tokenize(ROWS[0], TOKENIZER)])["input_ids"].shape[0] == 2
    with pytest.raises(UserError, match="algo.shared_prompt=true.*family 'opt'.*Fix: algo.shared_prompt=auto"):
        DPO(reference=NoReference(), shared_prompt=True).setup(opt, TOKENIZER)
    llama.config._attn_implementation = "flash_attention_2"
    assert "takes no custom mask" in shared_prompt.unsupported(llama, 1024)
    windowed = _model("mistral", sliding_window=64)
    assert "sliding window (64 tokens) is shorter than algo.max_length=1024" in shared_prompt.unsupported(windowed, 1024)
    assert shared_prompt.unsupported(windowed, 64) is None  # no sequence is longer than the window
    with_nll = DPO(reference=NoReference(), nll_weight=1.0, nll_on_prompt=True)
    with_nll.setup(_model(), TOKENIZER)
    assert not with_nll.shares_prompt  # that NLL scores the prompt of each chosen sequence
    with pytest.raises(UserError, match="algo.shared_prompt='sometimes' is not one of auto, true, false"):
        DPO(shared_prompt="sometimes")


def test_a_pair_whose_sequences_do_not_start_alike_is_refused():
    ids, mask = [1, 2, 3, 4], [0, 0, 1, 1]
    with pytest.raises(UserError, match="prompts of 2 and 3 tokens.*Fix: algo.shared_prompt=false"):
        shared_prompt.collate([ids], [mask], [ids], [[0, 0, 0, 1]], 0)
    with pytest.raises(UserError, match="different prompts"):
        shared_prompt.collate([ids], [mask], [[1, 5, 3, 4]], [mask], 0)

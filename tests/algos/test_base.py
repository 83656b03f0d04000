import torch

from rlhf import train
from rlhf.algos.base import Algorithm
from rlhf.algos.dpo import DPO
from rlhf.algos.sft import SFT
from rlhf.core.train_state import TrainState
from rlhf.data.collate import collate_sequences
from rlhf.data.loaders import Batches
from rlhf.embedded.tiny_model import TinySpec
from rlhf.ops.completion_logps import completion_stats
from tests.conftest import FAST, compose_config


def test_completion_stats_sum_completion_tokens_and_greedy_match_agrees_with_generate():
    policy = TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=0).build()
    model, tok = policy.model.eval(), policy.tokenizer
    prompt = list(b"xyz=")
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.pad_token_id)[0, 4:].tolist()
    wrong = generated[:3] + [(generated[3] + 1) % 256]
    batch = collate_sequences([prompt + generated, prompt + wrong, prompt + generated[:2]],
                              [[0] * 4 + [1] * 4, [0] * 4 + [1] * 4, [0] * 4 + [1] * 2], tok.pad_token_id)
    stats = completion_stats(model, batch)
    assert stats.greedy_match.tolist() == [True, False, True]
    assert stats.num_tokens.tolist() == [4, 4, 2]
    with torch.no_grad():
        logps = model(torch.tensor([prompt + wrong])).logits.log_softmax(-1)[0]
    manual = sum(logps[t - 1, (prompt + wrong)[t]].item() for t in range(4, 8))
    assert abs(stats.logps[1].item() - manual) < 1e-4


# --- the contract's optional parts: the loop calls them, with these defaults ------------------------------------
class _Source:
    """A batch source that hands out one fixed batch and counts the calls."""

    def __init__(self, batch) -> None:
        self.batch, self.calls = batch, 0

    def next(self):
        self.calls += 1
        return self.batch


class SFTFromOneBatch(SFT):
    """SFT whose every micro-batch is the first one of the default source (as an online algorithm would replace
    the data with batches of its own)."""

    source: _Source | None = None

    def batch_source(self, loader, state, accelerator, model=None):
        first = super().batch_source(loader, state, accelerator, model).next()
        SFTFromOneBatch.source = _Source(first)
        return SFTFromOneBatch.source


def test_the_loop_takes_its_micro_batches_from_batch_source(tmp_path):
    train(compose_config(*FAST, "algo=sft", "algo._target_=tests.algos.test_base.SFTFromOneBatch",
                         "train.max_steps=3", "train.grad_accumulation_steps=2", output_dir=tmp_path))
    assert SFTFromOneBatch.source is not None and SFTFromOneBatch.source.calls == 3 * 2


def test_defaults_of_the_optional_parts():
    algo = SFT()
    assert algo.state_dict() == {} and algo.load_state_dict({}) is None and algo.frozen == {}
    assert isinstance(algo.batch_source([], TrainState(), None), Batches)
    assert isinstance(DPO(), Algorithm) and isinstance(algo, Algorithm)


def test_completion_logits_only_computes_fewer_logits_and_the_same_losses_and_gradients():
    from rlhf.data.tasks import ReverseTask

    policy = TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=0).build()
    model, tok = policy.model, policy.tokenizer
    widths = []
    model.lm_head.register_forward_hook(lambda module, args, out: widths.append(out.shape[1]))
    for cls, columns in ((DPO, ("prompt", "chosen", "rejected")), (SFT, ("prompt", "completion"))):
        rows = ReverseTask().rows("train", columns)[:16]
        results = []
        for fast in (False, True):
            algo = cls(completion_logits_only=fast)
            algo.setup(model, tok)
            batch = algo.collate([algo.tokenize(row, tok) for row in rows])
            widths.clear()
            model.zero_grad()
            loss, metrics = algo.loss(model, batch)
            loss.backward()
            results.append((loss, metrics, [p.grad.clone() for p in model.parameters()], widths[0]))
        (loss, metrics, grads, full), (fast_loss, fast_metrics, fast_grads, kept) = results
        prompt_tokens = min(row.index("=") + 1 for row in (r["prompt"] for r in rows))  # "abc=" is 4 byte tokens
        assert full == batch["input_ids"].shape[1] and kept == full - prompt_tokens + 1  # from the last prompt token
        assert torch.equal(loss, fast_loss) and all(torch.equal(metrics[k], fast_metrics[k]) for k in metrics)
        for g, h in zip(grads, fast_grads):  # the output layer's gradient sums fewer rows: the last bits may move
            torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-6)
    assert DPO().completion_logits_only and SFT().completion_logits_only  # the default
    assert not DPO(completion_logits_only=True, nll_on_prompt=True).completion_logits_only  # the NLL scores prompts

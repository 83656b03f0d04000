"""Reference-model strategies (rlhf/models/reference.py, the config group algo/reference): each gives the first-step
loss that its definition says, on the tiny model and a small batch of preference pairs."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from rlhf.algos.dpo import DPO
from rlhf.core.errors import UserError
from rlhf.embedded.tiny_model import TinySpec
from rlhf.models.reference import FrozenCopy, NoReference, Pretrained, SharedLayers, disable_dropout
from rlhf.optim import param_groups
from tests.conftest import compose_config

ROWS = [{"prompt": "abc=", "chosen": "cba", "rejected": "cab"}, {"prompt": "hello=", "chosen": "olleh", "rejected": "hello"},
        {"prompt": "xyz=", "chosen": "zyx", "rejected": "zxy"}]


def _tiny(**extra):
    torch.manual_seed(0)
    return TinySpec(hidden_size=16, num_layers=3, num_heads=2, intermediate_size=32, warm_start_steps=0, **extra).build()


def _first_loss(policy, reference, beta: float = 0.1):
    algo = DPO(beta=beta, reference=reference)
    algo.setup(policy.model, policy.tokenizer)
    batch = algo.collate([algo.tokenize(r, policy.tokenizer) for r in ROWS])
    loss, _ = algo.loss(policy.model.train(), batch)
    return algo, batch, loss


def _perturbed(policy) -> None:
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))


def test_shared_layers_share_and_freeze_the_lower_layers_and_give_copys_first_loss_exactly():
    policy = _tiny()
    _, _, with_copy = _first_loss(policy, FrozenCopy())
    policy = _tiny()
    algo, _, with_shared = _first_loss(policy, SharedLayers(num_shared_layers=2))
    assert with_shared.item() == with_copy.item() == pytest.approx(math.log(2), abs=1e-6)
    ours, theirs = policy.model.model.layers, algo.ref_model.model.layers
    assert ours[0] is theirs[0] and ours[1] is theirs[1] and ours[2] is not theirs[2]  # shared, then a copy
    assert not any(p.requires_grad for p in ours[0].parameters()) and all(p.requires_grad for p in ours[2].parameters())
    trained = {id(p) for group in param_groups(policy.model) for p in group["params"]}
    assert not trained & {id(p) for p in ours[:2].parameters()}  # the optimizer never sees the shared layers
    with pytest.raises(UserError, match="at most 2"):
        SharedLayers(num_shared_layers=3)(_tiny().model)


def test_a_separately_given_reference_gives_the_published_formula_on_both_models_logps(tmp_path):
    """DPO's loss (Rafailov et al. 2023, eq. 7) computed independently from the two models' token log-probabilities."""
    reference = _tiny()
    _perturbed(reference)
    reference.model.save_pretrained(tmp_path / "ref")
    reference.tokenizer.save_pretrained(tmp_path / "ref")
    policy = _tiny()
    algo, batch, loss = _first_loss(policy, Pretrained(str(tmp_path / "ref")), beta=0.5)
    assert "branch_ids" in batch  # the loss ran on pairs around a shared prompt; the formula reads two sequences a pair
    plain = DPO(shared_prompt=False)
    plain.pad_id = algo.pad_id
    batch = plain.collate([plain.tokenize(r, policy.tokenizer) for r in ROWS])

    def summed_logps(model) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        tokens = batch["input_ids"][:, 1:]
        mask = batch["completion_mask"][:, 1:].float()
        return (torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0] * mask).sum(-1)

    pol, ref = summed_logps(policy.model.eval()), summed_logps(reference.model.eval())
    n = len(ROWS)
    expected = -F.logsigmoid(0.5 * ((pol[:n] - ref[:n]) - (pol[n:] - ref[n:]))).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5) and abs(loss.item() - math.log(2)) > 1e-3


def test_a_reference_with_another_vocabulary_is_refused(tmp_path):
    from transformers import AutoTokenizer

    other = _tiny()
    other.model.save_pretrained(tmp_path / "ref")
    other.tokenizer.save_pretrained(tmp_path / "ref")
    policy = _tiny()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ref")
    tokenizer.add_tokens(["<extra>"])
    with pytest.raises(UserError, match="another tokenizer than the policy"):
        Pretrained(str(tmp_path / "ref"))(policy.model, tokenizer)


def test_no_reference_uses_the_policys_own_logps():
    policy = _tiny()
    algo, batch, loss = _first_loss(policy, NoReference())
    assert algo.frozen == {}
    _, metrics = algo.loss(policy.model, batch)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1 * metrics["logps/chosen"].item(), rel=1e-6)


def test_disable_dropout_also_turns_off_attention_dropout_read_from_the_config():
    """With attention dropout 0.5 in the model's config (no nn.Dropout module carries it), the policy in train mode
    and its reference agree exactly at the start only once it is off too."""
    policy = _tiny(attention_dropout=0.5)
    _, _, loss = _first_loss(policy, FrozenCopy())
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    policy = _tiny(attention_dropout=0.5)
    algo = DPO(beta=0.1, reference=FrozenCopy(), disable_dropout=False)
    algo.setup(policy.model, policy.tokenizer)
    batch = algo.collate([algo.tokenize(r, policy.tokenizer) for r in ROWS])
    assert abs(algo.loss(policy.model.train(), batch)[0].item() - math.log(2)) > 1e-4  # dropout is really there
    disable_dropout(policy.model)
    assert policy.model.config.attention_dropout == 0.0


@pytest.mark.parametrize("option", ["copy", "model", "shared_layers", "precomputed", "none"])
def test_each_reference_option_composes_and_builds(option, tmp_path):
    from hydra.utils import instantiate

    extra = [f"algo.reference.name_or_path={tmp_path}"] if option == "model" else []
    cfg = compose_config("algo=dpo", f"algo/reference={option}", *extra)
    from hydra.utils import get_object

    assert type(instantiate(cfg.algo).reference) is get_object(cfg.algo.reference._target_)  # the one it names


def test_a_reference_model_without_its_path_is_refused_before_anything_loads():
    from rlhf.config.checks import check_config

    with pytest.raises(UserError, match=r"algo.reference.name_or_path: no value .*Fix: add algo.reference.name_or_path="):
        check_config(compose_config("algo=dpo", "algo/reference=model"))


@pytest.mark.parametrize("option", ["copy", "model", "shared_layers", "none"])
def test_dpo_runs_with_each_reference_option_on_the_embedded_default(option, tmp_path):
    """Three steps on the embedded default with each strategy, every step on the same 4 training rows. The loss the
    run logs at its last step, and its held-out loss at the end, are DPO's (Rafailov et al. 2023, eq. 7) on
    log-probabilities computed here: each pair through the policy (the step-2 checkpoint's, then the final one) and
    through the reference the option says it is: the initial policy (copy; shared_layers, whose shared layer is
    frozen in the policy and the layer above it a frozen copy), the model given (model: the initial policy
    perturbed), or none (the log-ratios are the policy's log-probabilities). No evaluation at the start, so that the
    one at the end runs the reference rather than reading values kept from the start. The policy trains far enough
    from its reference that a flipped sign, swapped answers or a reference equal to the policy would give another
    loss."""
    from hydra.utils import instantiate
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlhf import train
    from rlhf.core.instantiate import build
    from tests.conftest import FAST
    from tests.independent_logps import answer_logps, dpo_losses, mean

    overrides = [*FAST, "model.tiny.num_layers=2", "algo=dpo", f"algo/reference={option}", "data.task.num_train=4",
                 "optimizer.lr=1e-2", "scheduler=constant", "scheduler.num_warmup_steps=0",
                 "train.eval_at_start=false", "train.save_every_steps=2"]
    initial = build(compose_config(*overrides).model)
    reference = build(compose_config(*overrides).model).model
    if option == "model":  # another model than the initial policy, saved as a run's final/ would be
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        reference.save_pretrained(tmp_path / "ref")
        initial.tokenizer.save_pretrained(tmp_path / "ref")
        overrides.append(f"algo.reference.name_or_path={tmp_path / 'ref'}")
    cfg = compose_config(*overrides, output_dir=tmp_path / "run")
    assert cfg.train.per_device_batch_size == cfg.data.task.num_train and cfg.train.max_steps == 3  # one batch
    final = train(cfg)
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if '"train/loss"' in line][-1]
    assert last["step"] == 3
    after_two = build(compose_config(*overrides).model).model
    saved = load_file(tmp_path / "run" / "checkpoints" / "step_00000002" / "model.safetensors")
    missing, unexpected = after_two.load_state_dict(saved, strict=False)
    # not saved: one name of the tied embedding and output layer; a shared layer (frozen, never trained)
    frozen = {f"model.layers.0.{name}" for name, _ in after_two.model.layers[0].named_parameters()}
    assert not unexpected and set(missing) <= {"lm_head.weight", "model.embed_tokens.weight",
                                               *(frozen if option == "shared_layers" else ())}
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    task, tokenizer, beta = instantiate(cfg.data.task), initial.tokenizer, cfg.algo.beta
    apart = {"flipped": 0.0, "at_reference": 0.0}  # how far the losses of each break are from the right ones
    for split, policy, logged in (("train", after_two, last["train/loss"]), ("eval", trained, final["eval/loss"])):
        rows = task.rows(split, ["prompt", "chosen", "rejected"])
        prompts, chosen, rejected = ([r[k] for r in rows] for k in ("prompt", "chosen", "rejected"))
        if option == "none":
            ref_chosen = ref_rejected = [0.0] * len(rows)
        else:
            ref_chosen, ref_rejected = (answer_logps(reference, tokenizer, prompts, a) for a in (chosen, rejected))
        pc, pr = (answer_logps(policy, tokenizer, prompts, a) for a in (chosen, rejected))
        expected = mean(dpo_losses(pc, pr, ref_chosen, ref_rejected, beta))
        assert logged == pytest.approx(expected, abs=1e-5), (option, split)
        flipped = mean(dpo_losses(pr, pc, ref_rejected, ref_chosen, beta))  # a flipped sign, or swapped answers
        apart["flipped"] = max(apart["flipped"], abs(flipped - expected))
        apart["at_reference"] = max(apart["at_reference"], abs(math.log(2) - expected))  # the reference = the policy
        if option == "model":  # the initial policy in place of the model given
            ic, ir = (answer_logps(initial.model, tokenizer, prompts, a) for a in (chosen, rejected))
            apart["initial"] = max(apart.get("initial", 0.0), abs(mean(dpo_losses(pc, pr, ic, ir, beta)) - expected))
    assert min(apart.values()) > 1e-3, f"a broken loss would be within {apart} of the right one: the test cannot fail"
    if option == "shared_layers":  # the shared layer never trained; the one above it did
        ours, theirs = trained.model.layers, initial.model.model.layers
        assert all(torch.equal(a, b) for a, b in zip(ours[0].parameters(), theirs[0].parameters()))
        assert not all(torch.equal(a, b) for a, b in zip(ours[1].parameters(), theirs[1].parameters()))


def test_sharding_strategies_refuse_a_reference_that_shares_the_policys_layers():
    from rlhf.core.instantiate import build

    reference = SharedLayers(num_shared_layers=1)(_tiny().model)
    for option in ("fsdp", "zero3"):
        with pytest.raises(UserError, match="algo/reference=shared_layers .* not supported"):
            build(compose_config(f"hardware={option}").hardware).prepare_frozen(reference)

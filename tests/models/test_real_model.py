"""A real pretrained chat model (SmolLM2-135M-Instruct: a BPE tokenizer, a ChatML template, ``<|im_end|>`` as its
end of turn): conversational rows give the first-step loss TRL 1.16 gives on the same rows, for SFT, DPO (with a
reference that differs from the policy), the reward model and KTO; generation stops at the template's end of turn.

Each side gets the rows as a user has them (TRL's conversational format); ours go through the data pipeline
(:func:`rlhf.data.formats.standardize`, then the algorithm's ``tokenize``, ``collate`` and ``loss``), TRL's through its
trainer's own preparation and ``evaluate()`` in float32 on the CPU. Untruncated, and truncated: ``max_length`` keeps a
sequence's start as TRL's ``keep_start`` does, after ``max_prompt_length`` kept a prompt's end (TRL 1.16 has no such
option: its tokenized prompts are cut alike before its collator truncates). TRL's reward trainer drops a pair longer
than ``max_length`` instead of cutting it: no truncated comparison there.
"""

from __future__ import annotations

import copy
import importlib.util
import tempfile

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.real_model

_spec = importlib.util.spec_from_file_location("compare_with_trl", ROOT / "benchmarks" / "compare_with_trl.py")
_compare_with_trl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_compare_with_trl)

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
SINGLE = {"prompt": [{"role": "user", "content": "Name a primary colour."}],
          "chosen": [{"role": "assistant", "content": "Red is a primary colour."}],
          "rejected": [{"role": "assistant", "content": "Green, I think."}]}
MULTI = {"prompt": [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
                    {"role": "user", "content": "And times 3?"}],
         "chosen": [{"role": "assistant", "content": "12."}],
         "rejected": [{"role": "assistant", "content": "It is 7, as 4 + 3 = 7."}]}
PAIRS = [SINGLE, MULTI]
TOLERANCE = 1e-5  # measured: equal to the last bit on a CPU in float32 (the issue asked for 1e-4)


@pytest.fixture(scope="module")
def policy(real_model):
    from rlhf.models.loading import load_policy

    return load_policy(str(real_model))


def _perturbed(model, scale: float = 0.01):
    """A reference that differs from the policy: benchmarks/compare_with_trl.py's copy with seeded noise."""
    return _compare_with_trl.perturbed(model, scale)


def _ours(algo, rows, tokenizer, model, reference=None) -> float:
    """The first-step loss of ``algo`` on ``rows`` through the data pipeline, in eval mode (no dropout)."""
    from datasets import Dataset

    from rlhf.data.formats import standardize

    text = standardize(Dataset.from_list(rows), algo.columns, tokenizer)
    model = copy.deepcopy(model).eval()
    algo.setup(model, tokenizer)
    if reference is not None:
        algo.frozen = {"reference": reference}
    batch = algo.collate([algo.tokenize(row, tokenizer) for row in text])
    with torch.no_grad():
        return float(algo.loss(model, batch)[0])


def _trl(trainer_class, config_class, rows, tokenizer, model, prompt_tokens: int | None = None, **kwargs) -> float:
    """TRL's first-step loss on ``rows``; ``prompt_tokens``: each tokenized prompt cut to its last that many tokens
    before TRL's collator truncates to ``max_length`` (what ``max_prompt_length`` does, which TRL 1.16 lacks)."""
    from datasets import Dataset

    fields = kwargs.pop("fields", {})
    with tempfile.TemporaryDirectory() as out:
        args = config_class(output_dir=out, per_device_eval_batch_size=len(rows), report_to=[], use_cpu=True,
                            bf16=False, **fields)
        trainer = trainer_class(model=copy.deepcopy(model), args=args, processing_class=tokenizer,
                                train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows), **kwargs)
        if prompt_tokens is not None:
            trainer.eval_dataset = trainer.eval_dataset.map(lambda row: {"prompt_ids": row["prompt_ids"][-prompt_tokens:]})
        return trainer.evaluate()["eval_loss"]


def _cuts(pair: dict, tokenizer, max_prompt_length: int | None, max_length: int | None) -> list[int]:
    """What truncation cuts of a conversational ``pair``'s chosen and rejected sequences
    (:data:`rlhf.data.encoding.TRUNCATED`'s flags), as DPO tokenizes them."""
    from datasets import Dataset

    from rlhf.algos.dpo import DPO
    from rlhf.data.encoding import FORMAT_COLUMN, TRUNCATED, encode_answers
    from rlhf.data.formats import standardize

    row = standardize(Dataset.from_list([pair]), DPO.columns, tokenizer)[0]
    sides = encode_answers(tokenizer, row["prompt"], {side: row[side] for side in ("chosen", "rejected")},
                           row[FORMAT_COLUMN], max_prompt_length, max_length)
    return [sides[side][TRUNCATED] for side in ("chosen", "rejected")]


@pytest.mark.parametrize("rows", [[SINGLE], [MULTI]], ids=["single-turn", "multi-turn-with-system"])
def test_dpo_first_step_loss_equals_trls_on_conversational_pairs(policy, rows):
    from trl import DPOConfig, DPOTrainer

    from rlhf.algos.dpo import DPO

    reference = _perturbed(policy.model)
    ours = _ours(DPO(beta=0.1, max_length=None, max_prompt_length=None), rows, policy.tokenizer, policy.model,
                 reference)
    theirs = _trl(DPOTrainer, DPOConfig, rows, policy.tokenizer, policy.model, ref_model=copy.deepcopy(reference),
                  fields={"beta": 0.1, "max_length": None})
    assert abs(ours - theirs) < TOLERANCE, (ours, theirs)


# MULTI's prompt is 47 tokens, its answers 5 (chosen) and 17 (rejected) with the end of turn.
TRUNCATIONS = {
    # the sequence cut to 50 tokens, keeping its start: both answers lose their end
    "max_length": ({"max_length": 50, "max_prompt_length": None}, None),
    # the prompt cut to its last 40 tokens first (the system turn's start goes), then the sequence to 49: the
    # rejected answer loses its end, the chosen one fits
    "max_prompt_length": ({"max_length": 49, "max_prompt_length": 40}, 40),
}


@pytest.mark.parametrize("case", TRUNCATIONS)
def test_dpo_first_step_loss_equals_trls_when_truncated(policy, case):
    """Truncation keeps TRL's order: the prompt cut to ``max_prompt_length`` (its end kept), then the sequence to
    ``max_length`` (its start kept, as TRL's ``keep_start``); TRL 1.16 has no ``max_prompt_length``, so its tokenized
    prompts are cut as ours before its collator truncates (red: the sequence cut before the prompt, or its end kept)."""
    from trl import DPOConfig, DPOTrainer

    from rlhf.algos.dpo import DPO
    from rlhf.data.encoding import END_CUT, PROMPT_CUT

    limits, prompt_tokens = TRUNCATIONS[case]
    prompt_cut = PROMPT_CUT if prompt_tokens else 0
    assert _cuts(MULTI, policy.tokenizer, limits["max_prompt_length"], limits["max_length"]) == [
        prompt_cut | (0 if prompt_tokens else END_CUT), prompt_cut | END_CUT]
    reference = _perturbed(policy.model)
    ours = _ours(DPO(beta=0.1, **limits), [MULTI], policy.tokenizer, policy.model, reference)
    theirs = _trl(DPOTrainer, DPOConfig, [MULTI], policy.tokenizer, policy.model, prompt_tokens,
                  ref_model=copy.deepcopy(reference), fields={"beta": 0.1, "max_length": limits["max_length"]})
    assert abs(ours - theirs) < TOLERANCE, (ours, theirs)


def test_the_completion_is_the_templates_turn_with_no_second_end_token(policy):
    """The chosen answer ends ``<|im_end|> \\n`` as the template closes the turn; no EOS after it."""
    from datasets import Dataset

    from rlhf.algos.dpo import DPO
    from rlhf.data.formats import standardize

    tok = policy.tokenizer
    row = standardize(Dataset.from_list([SINGLE]), DPO.columns, tok)[0]
    encoded = DPO(max_length=None).tokenize(row, tok)
    mask = encoded["chosen_completion_mask"]
    completion = [t for t, m in zip(encoded["chosen_input_ids"], mask) if m]
    assert tok.convert_ids_to_tokens(completion) == ["Red", "Ġis", "Ġa", "Ġprimary", "Ġcolour", ".", "<|im_end|>",
                                                     "Ċ"]


@pytest.mark.parametrize("rows", [
    [{"prompt": SINGLE["prompt"], "completion": SINGLE["chosen"]}],
    [{"prompt": MULTI["prompt"], "completion": MULTI["chosen"]}],
    [{"messages": [*MULTI["prompt"], *MULTI["chosen"]]}],
], ids=["prompt-completion", "prompt-completion-multi-turn", "messages"])
def test_sft_first_step_loss_equals_trls_on_conversational_rows(policy, rows):
    from trl import SFTConfig, SFTTrainer

    from rlhf.algos.sft import SFT

    ours = _ours(SFT(max_length=None, max_prompt_length=None), rows, policy.tokenizer, policy.model)
    theirs = _trl(SFTTrainer, SFTConfig, rows, policy.tokenizer, policy.model, fields={"max_length": None})
    assert abs(ours - theirs) < TOLERANCE, (ours, theirs)


def test_sft_first_step_loss_equals_trls_when_truncated(policy):
    """``max_length`` cuts a sequence's end, as TRL's SFT trainer does (``keep_start``): 50 tokens of MULTI's 64 with
    its rejected answer (red: the end kept instead)."""
    from trl import SFTConfig, SFTTrainer

    from rlhf.algos.sft import SFT
    from rlhf.data.encoding import END_CUT

    assert _cuts(MULTI, policy.tokenizer, None, 50) == [END_CUT, END_CUT]
    rows = [{"prompt": MULTI["prompt"], "completion": MULTI["rejected"]}]
    ours = _ours(SFT(max_length=50, max_prompt_length=None), rows, policy.tokenizer, policy.model)
    theirs = _trl(SFTTrainer, SFTConfig, rows, policy.tokenizer, policy.model, fields={"max_length": 50})
    assert abs(ours - theirs) < TOLERANCE, (ours, theirs)


def test_kto_first_step_loss_equals_trls_when_truncated(policy):
    """``max_length`` at 50: MULTI's rows lose their answers' end (SINGLE's fit), and so do the mismatched pairs of
    the KL estimate, each cut after pairing as TRL's KTO collator cuts it (``keep_start``)."""
    from trl import KTOConfig, KTOTrainer

    from rlhf.algos.kto import KTO
    from rlhf.data.encoding import END_CUT

    assert _cuts(MULTI, policy.tokenizer, None, 50) == [END_CUT, END_CUT]
    assert _cuts(SINGLE, policy.tokenizer, None, 50) == [0, 0]
    rows = ([{"prompt": p["prompt"], "completion": p["chosen"], "label": True} for p in PAIRS]
            + [{"prompt": p["prompt"], "completion": p["rejected"], "label": False} for p in PAIRS])
    noisy = _perturbed(policy.model, 0.02)
    ours = _ours(KTO(beta=0.1, max_length=50, max_prompt_length=None), rows, policy.tokenizer, noisy,
                 policy.model.eval())
    theirs = _trl(KTOTrainer, KTOConfig, rows, policy.tokenizer, noisy, ref_model=copy.deepcopy(policy.model),
                  fields={"beta": 0.1, "max_length": 50})
    assert abs(ours - theirs) < TOLERANCE, (ours, theirs)


def test_reward_model_first_step_loss_equals_trls_on_conversational_pairs(real_model, policy):
    """(A second EOS after the turn, as before, is not seen here: this tokenizer pads with its EOS, and the score is
    read at the last token before the first pad.)"""
    from trl import RewardConfig, RewardTrainer

    from rlhf.algos.reward import Reward
    from rlhf.models.loading import load_policy

    scorer = load_policy(str(real_model), head="sequence_classification").model
    with torch.no_grad():  # a new score head, seeded, wide enough that the pairs' rewards differ (the same model on
        # both sides; transformers' own initialization gives rewards near 0 and a loss near log 2 whatever is read)
        scorer.score.weight.copy_(0.1 * torch.randn(scorer.score.weight.shape, generator=torch.Generator().manual_seed(0)))
    ours = _ours(Reward(max_length=None, max_prompt_length=None), PAIRS, policy.tokenizer, scorer)
    theirs = _trl(RewardTrainer, RewardConfig, PAIRS, policy.tokenizer, scorer, fields={"max_length": None})
    assert abs(ours - theirs) < TOLERANCE, (ours, theirs)


def test_kto_first_step_loss_equals_trls_on_conversational_rows(policy):
    """KTO's KL estimate pairs each prompt with another row's completion: the same unpaired rows in the same order on
    both sides (TRL unpairs all chosen answers, then all rejected ones). The noisy copy is the policy and the model
    the reference, so that the estimate, floored at 0, is not 0."""
    from trl import KTOConfig, KTOTrainer

    from rlhf.algos.kto import KTO

    rows = ([{"prompt": p["prompt"], "completion": p["chosen"], "label": True} for p in PAIRS]
            + [{"prompt": p["prompt"], "completion": p["rejected"], "label": False} for p in PAIRS])
    noisy = _perturbed(policy.model, 0.02)
    ours = _ours(KTO(beta=0.1, max_length=None, max_prompt_length=None), rows, policy.tokenizer, noisy,
                 policy.model.eval())
    theirs = _trl(KTOTrainer, KTOConfig, rows, policy.tokenizer, noisy, ref_model=copy.deepcopy(policy.model),
                  fields={"beta": 0.1, "max_length": None})
    assert abs(ours - theirs) < TOLERANCE, (ours, theirs)


def test_generation_stops_at_the_templates_end_of_turn_and_rewards_read_text_without_it(policy):
    from rlhf.algos.online import collate_prompts, tokenize_prompt
    from rlhf.data.encoding import CHAT, FORMAT_COLUMN
    from rlhf.models.generation import Sampling, sample, stop_ids

    tok = policy.tokenizer
    question = [{"role": "user", "content": "Reply with one word: what colour is the sky?"}]  # a short answer
    prompt = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    batch = collate_prompts([tokenize_prompt({"prompt": prompt, FORMAT_COLUMN: CHAT}, tok, None)], tok.pad_token_id)
    settings = Sampling(max_new_tokens=48, pad_id=tok.pad_token_id, eos_ids=stop_ids(tok, policy.model),
                        tokenizer=tok)
    out = sample(policy.model, batch["input_ids"], batch["attention_mask"], 1, None, settings)
    kept = out["completion_ids"][0][out["completion_mask"][0].bool()].tolist()
    assert not out["truncated"][0] and tok.convert_ids_to_tokens(kept[-1]) == "<|im_end|>", out["completions"]
    assert out["completions"][0] and "<|im_end|>" not in out["completions"][0]
    assert batch["input_ids"][0].tolist() == tok.apply_chat_template(question, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=True)["input_ids"]

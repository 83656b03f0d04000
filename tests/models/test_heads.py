import pytest
import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from rlhf.config import build, check_config
from rlhf.data.tasks import ReverseTask
from rlhf.errors import UserError
from rlhf.models.loading import load_policy
from rlhf.models.tiny import TinySpec
from tests.conftest import FAST, compose_config

SMALL = dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)


def test_the_head_is_chosen_by_the_model_group():
    assert compose_config(*FAST).model.head == "causal_lm"
    assert compose_config("algo=sft", *FAST).model.head == "causal_lm"
    assert isinstance(build(compose_config(*FAST).model).model, LlamaForCausalLM)
    # algo=reward asks for its head (algo.head); every model preset follows it, Hub-named ones included.
    for model in ("tiny", "gpt2", "pythia-160m", "qwen2.5-0.5b", "llama-3.2-1b"):
        assert compose_config("algo=reward", f"model={model}").model.head == "sequence_classification"
    reward = build(compose_config("algo=reward", *FAST).model).model
    assert isinstance(reward, LlamaForSequenceClassification) and reward.config.num_labels == 1
    # ... and a field like any other: set from the command line.
    chosen = compose_config("model.head=sequence_classification", *FAST).model
    assert isinstance(build(chosen).model, LlamaForSequenceClassification)


@pytest.mark.parametrize("head, message", [("value", "not implemented yet"), ("lm", "is not one of")])
def test_an_unbuildable_head_is_refused_before_anything_loads(head, message):
    with pytest.raises(UserError, match=message):
        check_config(compose_config(f"model.head={head}", *FAST))


def test_the_tiny_reward_model_keeps_the_warm_started_backbone_under_a_fresh_score(tmp_path):
    spec = TinySpec(**SMALL, warm_start_steps=3, warm_start_batch_size=4, cache_dir=str(tmp_path),
                    task=ReverseTask(num_train=16, num_eval=4))
    causal, reward = spec.build().model, spec.build("sequence_classification").model
    backbone = causal.base_model.state_dict()
    assert backbone.keys() == reward.base_model.state_dict().keys()
    assert all(torch.equal(value, reward.base_model.state_dict()[key]) for key, value in backbone.items())
    again = spec.build("sequence_classification").model
    assert torch.equal(reward.score.weight, again.score.weight)  # seeded by init_seed
    assert reward.config.pad_token_id is not None and len(list(tmp_path.iterdir())) == 1  # one cached warm start


def test_a_saved_causal_lm_loads_with_a_new_sequence_classification_head(tmp_path):
    policy = TinySpec(**SMALL, warm_start_steps=0).build()
    policy.model.config.pad_token_id = None  # as many Hub models: the loader sets it from the tokenizer
    policy.model.save_pretrained(tmp_path)
    policy.tokenizer.save_pretrained(tmp_path)
    loaded = load_policy(str(tmp_path), head="sequence_classification")
    assert isinstance(loaded.model, LlamaForSequenceClassification)
    assert loaded.model.config.pad_token_id == loaded.tokenizer.pad_token_id
    assert torch.equal(loaded.model.base_model.embed_tokens.weight, policy.model.base_model.embed_tokens.weight)


def test_a_log_likelihood_algorithm_refuses_a_model_without_next_token_logits():
    cfg = compose_config("algo=sft", "model.head=sequence_classification", *FAST)
    policy, algo = build(cfg.model), build(cfg.algo)
    algo.setup(policy.model, policy.tokenizer)
    batch = algo.collate([algo.tokenize({"prompt": "ab=", "completion": "ba"}, policy.tokenizer)])
    with pytest.raises(UserError, match="model.head=causal_lm"):
        algo.loss(policy.model, batch)

import pytest
import torch
from transformers import (
    AutoModelForTokenClassification,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
)

from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.core.instantiate import build
from rlhf.data.tasks import ReverseTask
from rlhf.embedded.tiny_model import TinySpec
from rlhf.hardware.fsdp import layers_to_shard
from rlhf.models.loading import load_policy
from rlhf.models.value import token_values
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


def test_an_unknown_head_is_refused_before_anything_loads():
    with pytest.raises(UserError, match=r"model.head='lm' is not one of .*'value'.* Fix: e.g. model.head=causal_lm"):
        check_config(compose_config("model.head=lm", *FAST))


def test_the_value_head_gives_a_value_per_token_and_saves_and_reloads_equal(tmp_path):
    """model.head=value on the embedded model: the causal LM's backbone (same weights) under a one-label token
    classifier without dropout; [B, T] values; saved with save_pretrained, it loads back (by the loader and by
    transformers' Auto class alone) with equal values."""
    cfg = compose_config("model.head=value", *FAST)
    check_config(cfg)
    policy, causal = build(cfg.model), build(compose_config(*FAST).model).model
    model = policy.model
    assert isinstance(model, LlamaForTokenClassification) and model.config.num_labels == 1
    assert model.config.classifier_dropout == 0.0 and model.dropout.p == 0.0
    assert len(layers_to_shard(model, None)) == 1  # FSDP2 finds its decoder layer, as in a causal LM
    backbone = causal.base_model.state_dict()
    assert backbone.keys() == model.base_model.state_dict().keys()
    assert all(torch.equal(value, model.base_model.state_dict()[key]) for key, value in backbone.items())
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 2], [1, 7, 11, 2, 0, 0, 0]])
    mask = (ids != 0).long()
    model.train()  # no dropout: training mode gives the same values
    values = token_values(model, ids, mask)
    assert values.shape == (2, 7) and values.dtype == torch.float32 and values.std() > 0
    model.save_pretrained(tmp_path)
    policy.tokenizer.save_pretrained(tmp_path)
    for loaded in (load_policy(str(tmp_path), head="value").model, AutoModelForTokenClassification.from_pretrained(
            tmp_path)):
        assert type(loaded) is LlamaForTokenClassification
        assert torch.equal(token_values(loaded, ids, mask), values)
    with pytest.raises(UserError, match="Fix: model.head=value"):
        token_values(causal, ids, mask)


def test_a_saved_causal_lm_loads_with_a_new_value_head(tmp_path):
    policy = TinySpec(**SMALL, warm_start_steps=0).build()
    policy.model.save_pretrained(tmp_path)
    policy.tokenizer.save_pretrained(tmp_path)
    loaded = load_policy(str(tmp_path), head="value").model
    assert isinstance(loaded, LlamaForTokenClassification) and loaded.dropout.p == 0.0
    assert torch.equal(loaded.base_model.embed_tokens.weight, policy.model.base_model.embed_tokens.weight)
    assert token_values(loaded, torch.tensor([[1, 5, 9]]), torch.ones(1, 3, dtype=torch.long)).shape == (1, 3)


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


@pytest.mark.parametrize("head", ["sequence_classification", "value"])
def test_a_log_likelihood_algorithm_refuses_a_model_without_next_token_logits(head):
    cfg = compose_config("algo=sft", f"model.head={head}", *FAST)
    policy, algo = build(cfg.model), build(cfg.algo)
    algo.setup(policy.model, policy.tokenizer)
    batch = algo.collate([algo.tokenize({"prompt": "ab=", "completion": "ba"}, policy.tokenizer)])
    with pytest.raises(UserError, match="model.head=causal_lm"):
        algo.loss(policy.model, batch)

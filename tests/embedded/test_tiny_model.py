import torch

from rlhf.data.tasks import ReverseTask
from rlhf.embedded.tiny_model import TinySpec

SMALL = dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)


def test_random_init_is_deterministic_from_the_seed():
    a, b = TinySpec(**SMALL, warm_start_steps=0).build(), TinySpec(**SMALL, warm_start_steps=0).build()
    c = TinySpec(**SMALL, warm_start_steps=0, init_seed=1).build()
    first = lambda p: next(p.model.parameters())  # noqa: E731
    assert torch.equal(first(a), first(b)) and not torch.equal(first(a), first(c))


def test_warm_start_trains_once_and_is_then_loaded_from_cache(tmp_path, monkeypatch):
    spec = TinySpec(**SMALL, warm_start_steps=3, warm_start_batch_size=4, cache_dir=str(tmp_path),
                    task=ReverseTask(num_train=16, num_eval=4))
    trained = spec.build()
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and (entries[0] / "config.json").exists() and (entries[0] / "tokenizer.json").exists()
    initial = TinySpec(**SMALL, warm_start_steps=0).build()
    assert not torch.equal(next(trained.model.parameters()), next(initial.model.parameters()))

    def train_again(self, folder):
        raise AssertionError("trained twice: the cached warm start was not used")

    # The warm start is deterministic and a second save into the folder is dropped: only this tells a cache hit.
    monkeypatch.setattr(TinySpec, "_train_and_save", train_again)
    again = spec.build()
    assert torch.equal(next(trained.model.parameters()), next(again.model.parameters()))
    assert len(list(tmp_path.iterdir())) == 1  # no second entry, no leftover staging folder


def test_the_warm_start_recipe_does_not_follow_sfts_defaults(tmp_path, monkeypatch):
    """The cached warm start is built by an explicit recipe: SFT with every option given, so a change of SFT's
    defaults (as ``completion_logits_only`` once changed) cannot change a fresh warm start."""
    import inspect

    import rlhf.embedded.tiny_model as tiny
    from rlhf.algos.sft import SFT

    def build(folder):
        spec = TinySpec(**SMALL, warm_start_steps=3, warm_start_batch_size=4, cache_dir=str(tmp_path / folder),
                        task=ReverseTask(num_train=16, num_eval=4))
        return [p.detach().clone() for p in spec.build().model.parameters()]

    before = build("a")
    other = {bool: lambda d: not d, str: lambda d: True}  # fused_output_layer="auto" -> true
    flipped = {name: other.get(type(p.default), lambda d: 64)(p.default)
               for name, p in inspect.signature(SFT.__init__).parameters.items() if name != "self"}

    class OtherDefaults(SFT):
        def __init__(self, **given):
            super().__init__(**{**flipped, **given})

    monkeypatch.setattr(tiny, "SFT", OtherDefaults)
    after = build("b")
    assert all(torch.equal(a, b) for a, b in zip(before, after))

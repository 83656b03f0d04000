"""What spawned test processes run, in a module of its own (light imports: a spawned process imports its target's
module)."""

from __future__ import annotations

import contextlib
import datetime

import torch


def generation_gathers(rank: int, port: int, results) -> None:
    """Process ``rank`` of 2 (gloo): a tiny Llama sharded with FSDP2 (each decoder layer, then the root) generates 8
    tokens greedily from its own prompt, with its parameters gathered at every forward pass (``synced_gpus``) and
    within :func:`rlhf.models.generation.gathered_for_generation`; ``results[rank]`` = {way: (all-gathers, ids)},
    plus the all-gathers of one forward pass after the block."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from rlhf.models.generation import gathered_for_generation
        from rlhf.models.tiny import TinySpec

        mesh = init_device_mesh("cpu", (2,))

        def sharded_model():
            torch.manual_seed(0)
            built = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                             warm_start_steps=0).build().model.eval()
            for layer in built.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(built, mesh=mesh)
            return built

        model = sharded_model()
        calls = [0]
        for name in ("all_gather_single", "all_gather_into_tensor", "all_gather"):  # FSDP2: all_gather_single
            original = getattr(torch.distributed, name)

            def counted(*args, __original=original, **kwargs):
                calls[0] += 1
                return __original(*args, **kwargs)

            setattr(torch.distributed, name, counted)
        ids = torch.tensor([[257, 97, 98, 61] if rank == 0 else [257, 120, 121, 122, 61]])
        out = {}
        for way in ("every forward", "once"):
            calls[0] = 0
            block = contextlib.nullcontext(True) if way == "every forward" else gathered_for_generation(model)
            with torch.no_grad(), block as still_sharded:
                generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                           do_sample=False, synced_gpus=still_sharded, pad_token_id=256,
                                           eos_token_id=258)
            out[way] = (calls[0], generated[0, ids.shape[1]:].tolist(), still_sharded)
        calls[0] = 0
        with torch.no_grad():
            model(input_ids=ids)
        out["forward after"] = calls[0]
        # a training step's all-gathers after a block, whether or not a forward pass ran before it (FSDP2 settles the
        # root's resharding at its first forward: that must not happen inside the block)
        fresh = sharded_model()
        with torch.no_grad(), gathered_for_generation(fresh) as still_sharded:
            fresh.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                           synced_gpus=still_sharded, pad_token_id=256, eos_token_id=258)
        for name, trained in (("step after forward-first", model), ("step after generation-first", fresh)):
            trained.train()
            for _ in range(2):  # the second step's: the steady state
                calls[0] = 0
                trained(input_ids=ids).logits.sum().backward()
            out[name] = calls[0]
        results[rank] = out
    finally:
        torch.distributed.destroy_process_group()

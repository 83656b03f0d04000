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

        from rlhf.embedded.tiny_model import TinySpec
        from rlhf.models.generation import gathered_for_generation

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


def zero3_generation_gathers(rank: int, port: int, results) -> None:
    """Process ``rank`` of 2 (gloo): a tiny Llama partitioned by a DeepSpeed ZeRO-3 engine (every parameter split:
    no persistence threshold) generates 4 and 12 tokens greedily from its own prompt, with the engine's hooks
    gathering each layer at every forward pass (``synced_gpus``) and within
    :func:`rlhf.models.generation.gathered_for_generation`; then two training steps. ``results[rank]`` = {(way,
    tokens): (all-gathers, ids, still sharded)}, the all-gathers of the training steps, their losses, and the engine's hook
    and module-stack counts before and after."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from rlhf.hardware.zero import import_deepspeed

    deepspeed = import_deepspeed(cuda=False)
    deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        from deepspeed.runtime.zero import parameter_offload

        from rlhf.embedded.tiny_model import TinySpec
        from rlhf.models.generation import gathered_for_generation

        torch.manual_seed(0)
        built = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                         warm_start_steps=0).build().model
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 62}
        engine, *_ = deepspeed.initialize(model=built, optimizer=torch.optim.SGD(built.parameters(), lr=0.1),
                                          config=config)
        offload = engine.optimizer.parameter_offload
        hooks = lambda: (len(offload.forward_hooks), len(offload.backward_hooks),  # noqa: E731
                         len(parameter_offload.FWD_MODULE_STACK))
        calls = [0]
        backend = deepspeed.comm.comm.cdb  # DeepSpeed's communication backend: every all-gather of ZeRO-3 goes there
        for name in dir(backend):
            if name.startswith("all_gather") and callable(getattr(backend, name)):
                original = getattr(backend, name)

                def counted(*args, __original=original, **kwargs):
                    calls[0] += 1
                    return __original(*args, **kwargs)

                setattr(backend, name, counted)
        ids = torch.tensor([[257, 97, 98, 61] if rank == 0 else [257, 120, 121, 122, 61]])
        out = {"hooks before": hooks()}
        engine.module.eval()
        for tokens in (4, 12):
            for way in ("every forward", "once"):
                calls[0] = 0
                block = contextlib.nullcontext(True) if way == "every forward" else gathered_for_generation(engine)
                with torch.no_grad(), block as still_sharded:
                    generated = engine.module.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                        min_new_tokens=tokens, do_sample=False, synced_gpus=still_sharded, pad_token_id=256,
                        eos_token_id=258)
                out[way, tokens] = (calls[0], generated[0, ids.shape[1]:].tolist(), still_sharded)
        out["hooks after"] = hooks()
        out["parameters partitioned after"] = all(p.numel() == 0 or p.ds_status.name == "NOT_AVAILABLE"
                                                   for p in engine.module.parameters())
        engine.module.train()
        losses = []

        def step() -> None:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))

        for _ in range(2):
            calls[0] = 0
            step()
        out["step after"] = calls[0]
        engine.module.eval()  # a rollout after training steps (the coordinator has recorded its trace), then more
        calls[0] = 0
        with torch.no_grad(), gathered_for_generation(engine) as still_sharded:
            engine.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                   min_new_tokens=12, do_sample=False, synced_gpus=still_sharded, pad_token_id=256,
                                   eos_token_id=258)
        out["once after training"] = calls[0]
        engine.module.train()
        for _ in range(2):
            step()
        out["losses"] = losses
        results[rank] = out
    finally:
        torch.distributed.destroy_process_group()

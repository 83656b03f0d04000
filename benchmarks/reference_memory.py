"""Measure the memory each process holds for DPO's reference model under a hardware option, on 2 CPU processes.

    python benchmarks/reference_memory.py                         # cpu_ddp, fsdp, zero3 on a hidden-512 tiny Llama
    python benchmarks/reference_memory.py --options cpu_ddp fsdp --hidden-size 256 --layers 2

For each option (``conf/hardware/<option>.yaml`` with 2 processes, each option in a fresh pair of processes, one
thread each) every rank builds the embedded model (random init, no warm start), then makes the reference as
``algo/reference=copy`` does and hands it to ``strategy.prepare_frozen``, as a run does. Printed per rank:

- the reference's parameter bytes this process holds (:attr:`~rlhf.hardware.DataParallel.frozen_held`), against
  the whole model's, and the share the strategy predicts (:meth:`~rlhf.hardware.DataParallel.frozen_share`, what
  the memory preflight reads);
- the process's resident memory (RSS, from ``/proc/self/statm``) after placing the reference minus before making
  it, with freed heap given back to the system first (``malloc_trim``) so that RSS counts what is held: a copy
  made whole and then sharded costs the whole model for a moment, not for the run;
- the same after one forward pass of the reference (8 sequences of 64 tokens, no gradients): the sharded models
  gather each layer for its forward and free it after. This one is noisier: what the allocator keeps after the
  forward moves by about one gathered layer between calls (seen under FSDP2: +60 MiB, then +76, then +60).

ZeRO options need DeepSpeed (``pip install 'rlhf[deepspeed]'``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
from pathlib import Path

import torch

from rlhf.hardware import free_port

CONF = Path(__file__).resolve().parents[1] / "conf"
MIB = 2**20


def rss_bytes() -> int:
    """This process's resident memory, after collecting garbage and returning the freed heap to the system."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS may keep freed pages
        pass
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(option: str, arch: dict) -> dict:
    """One rank: place a reference with ``option``'s strategy; what it holds and what it costs."""
    from hydra import compose, initialize_config_dir

    from rlhf.core.instantiate import build
    from rlhf.embedded.tiny_model import TinySpec
    from rlhf.models.reference import FrozenCopy

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"hardware={option}", "hardware.device=cpu", "hardware.num_processes=2",
                                           "hardware.timeout_s=120", "output_dir=unused"])
    strategy = build(cfg.hardware)
    strategy.start()
    policy = TinySpec(**arch, warm_start_steps=0).build().model
    strategy.unwrap(torch.nn.Linear(1, 1))  # Accelerate's unwrap imports DeepSpeed where installed: ~23 MiB of code
    before = rss_bytes()
    reference = strategy.prepare_frozen(FrozenCopy()(policy), name="reference")
    placed = rss_bytes()
    ids = torch.randint(1, 200, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference(input_ids=ids, attention_mask=torch.ones_like(ids))
    forward = rss_bytes()
    held = strategy.frozen_held["reference"]
    whole_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return {"held_bytes": held.local_bytes, "share": held.share, "predicted": strategy.frozen_share(),
            "whole_bytes": whole_bytes, "rss_placed": placed - before, "rss_forward": forward - before}


def launch(option: str, arch: dict) -> dict[int, dict]:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=f"reference-memory-{option}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=None))
    return elastic_launch(config, measure)(option, arch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", nargs="+", default=["cpu_ddp", "fsdp", "zero3"],
                        help="hardware options (conf/hardware), each run on 2 CPU processes; ZeRO-3 last")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    args = parser.parse_args()
    arch = {"hidden_size": args.hidden_size, "num_layers": args.layers, "num_heads": args.heads,
            "intermediate_size": args.intermediate_size}
    os.environ["OMP_NUM_THREADS"] = "1"  # 2 processes x 1 thread: never more than 2 CPUs
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {option: launch(option, arch) for option in args.options}
    whole = results[args.options[0]][0]["whole_bytes"]
    print(f"\nDPO reference of a tiny Llama {arch}: {whole / MIB:.1f} MiB of fp32 parameters; 2 CPU processes, "
          f"torch {torch.__version__}\n")
    print("| hardware | reference parameters held per rank (rank 0 / rank 1) | share (predicted) "
          "| RSS after placing it, per rank | RSS after one forward, per rank |")
    print("|---|---|---|---|---|")
    for option, ranks in results.items():
        r0, r1 = ranks[0], ranks[1]
        print(f"| `{option}` | {r0['held_bytes'] / MIB:.1f} / {r1['held_bytes'] / MIB:.1f} MiB "
              f"| {r0['share']:.0%} / {r1['share']:.0%} ({r0['predicted']:.0%}) "
              f"| +{r0['rss_placed'] / MIB:.1f} / +{r1['rss_placed'] / MIB:.1f} MiB "
              f"| +{r0['rss_forward'] / MIB:.1f} / +{r1['rss_forward'] / MIB:.1f} MiB |")


if __name__ == "__main__":
    main()

"""Whether this machine multiplies bf16 matrices in hardware: what a choice between bf16 and float32 compute reads
(``hardware.mixed_precision=auto``, Muon's Newton-Schulz dtype, the peak FLOP/s of the MFU)."""

from __future__ import annotations

import torch


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware: AVX-512 BF16 (Intel Cooper Lake and later Xeons, AMD
    Zen 4 on) or AMX (Intel Sapphire Rapids on), as torch's own CPU checks read them. Without them (AVX2 laptops,
    older servers) bf16 is emulated and slower than float32; ARM CPUs answer no until measured."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    try:
        return any(check is not None and bool(check()) for check in checks)
    except RuntimeError:  # a torch build without the CPU capability checks
        return False

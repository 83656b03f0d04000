"""rlhf/telemetry/profiling.py's memory record: the peak of a CUDA allocator trace and what was live at it, by place; and the
option refused where it cannot run."""

from __future__ import annotations

import pytest

from rlhf import train
from rlhf.core.errors import UserError
from rlhf.telemetry.profiling import memory_at_peak

TORCH = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}
MODEL = {"filename": "/x/site-packages/transformers/models/llama/modeling_llama.py", "line": 7, "name": "forward"}
OURS = {"filename": "/x/rlhf/ops/token_logps.py", "line": 9, "name": "forward"}
NATIVE = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"}  # a C++ frame


def test_the_peak_is_replayed_from_the_trace_and_what_was_live_is_grouped_by_the_first_frame_outside_torch():
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": [NATIVE, TORCH, MODEL]},
              {"action": "alloc", "addr": 2, "size": 50, "frames": [OURS]},
              {"action": "free_requested", "addr": 1, "size": 100},
              {"action": "free_completed", "addr": 1, "size": 100},  # counted once
              {"action": "alloc", "addr": 3, "size": 120, "frames": [NATIVE, TORCH, MODEL]},
              {"action": "alloc", "addr": 4, "size": 60, "frames": [TORCH, MODEL]},  # the peak: 50 + 120 + 60
              {"action": "free_requested", "addr": 3, "size": 120},
              {"action": "alloc", "addr": 5, "size": 90, "frames": [TORCH]},  # 200 < 230: not a new peak
              {"action": "free_completed", "addr": 99, "size": 7}]  # allocated before the recording: ignored
    peak, table = memory_at_peak({"device_traces": [events]})
    assert peak == 230
    assert table == [(180, 2, "models/llama/modeling_llama.py:7 forward"), (50, 1, "rlhf/ops/token_logps.py:9 forward")]
    assert memory_at_peak({"device_traces": []}) == (0, [])


def test_profile_memory_is_refused_without_profiled_steps_and_on_a_cpu(fast_config):
    with pytest.raises(UserError, match=r"train.profile_memory=true .* Fix: train.profile_steps=2"):
        train(fast_config("train.profile_memory=true"))
    with pytest.raises(UserError, match="it needs a GPU. Fix: train.profile_memory=false"):
        train(fast_config("train.profile_memory=true", "train.profile_steps=1", "train.log_every_steps=1"))

"""rlhf/data/layout_masks.py under torch's compiler: the block mask built by the compiled construction a GPU uses
(``create_block_mask(_compile=True)``, inductor), and flex attention compiled by inductor under it, against the
mask built eagerly and against sdpa under the dense mask of the same rule. Forward only: flex attention has no
backward pass on a CPU (tests/data/test_packed_pairs.py trains through its eager reference instead)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex

from rlhf.data import layout_masks, shared_prompt

PAIRS = ((100, 60, 40), (0, 90, 70), (50, 30, 20))  # (prompt, chosen, rejected) tokens: 462 packed, 4 blocks of 128


def _packed_batch() -> dict:
    """Three pairs packed into one row around their prompts (one without a prompt), long enough that the 128-token
    blocks of flex attention's mask differ: some seen in full, some in part, some skipped."""
    chosen, chosen_masks, rejected, rejected_masks = [], [], [], []
    for prompt, a, b in PAIRS:
        chosen.append([5] * prompt + [6] * a)
        chosen_masks.append([0] * prompt + [1] * a)
        rejected.append([5] * prompt + [7] * b)
        rejected_masks.append([0] * prompt + [1] * b)
    return shared_prompt.collate_packed(chosen, chosen_masks, rejected, rejected_masks)


@pytest.fixture(scope="module", autouse=True)
def fresh_compiler():
    """The compiler's caches emptied after this module: the shapes compiled here would otherwise make a later flex
    attention of another length (transformers compiles it) recompile with dynamic shapes, whose C++ template
    inductor 2.13 fails to build (``cur_kvSplitSize8`` undeclared)."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def masks():
    """The packed batch's branch and document ids, its block mask built eagerly and by the compiled construction
    (inductor: the mask's rule and its reduction to blocks generated as C++ and compiled), and how many graphs
    inductor compiled for it."""
    from torch._dynamo.utils import counters

    branch, documents = layout_masks._layout(_packed_batch())  # noqa: SLF001  (the ids model_inputs builds the mask from)
    torch._dynamo.reset()
    counters.clear()
    eager = layout_masks.block_mask(branch, documents)  # on a CPU: evaluated eagerly
    compiled = layout_masks.block_mask(branch, documents, compiled=True)
    graphs = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]
    return branch, documents, eager, compiled, graphs


@pytest.mark.slow
def test_the_compiled_construction_of_the_block_mask_gives_the_eager_ones_blocks(masks):
    """Which blocks to skip, which to compute in full and which through the rule: the same from the construction
    compiled by inductor as from the eager one, and what the packing implies (each pair skips the pairs before it).
    Red where inductor compiles nothing (the construction left eager), or where the compiled construction's rule mixes
    the pairs (their document ids dropped)."""
    branch, _, eager, compiled, graphs = masks
    # each pair in turn (a rejected branch starts again from its prompt's last token): tokens 0-200, 201-360, 361-461
    assert branch.shape[1] == sum(p + a + b + (p > 0) for p, a, b in PAIRS) == 462
    assert graphs >= 1
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
    assert compiled.to_dense()[0, 0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


@pytest.mark.slow
def test_flex_attention_compiled_by_inductor_under_the_compiled_mask_gives_the_dense_masks_attention(masks):
    """Flex attention compiled by inductor (its CPU kernel, which skips the blocks the mask skips) under the mask of
    the compiled construction: what sdpa gives under the dense mask of the same rule, forward. Red under a compiled
    mask that lets the pairs see each other (their document ids dropped: off by up to 2.4)."""
    branch, documents, _, compiled, _ = masks
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 2, branch.shape[1], 16) for _ in range(3))
    dense = layout_masks.dense_mask(branch, documents)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=dense)
    got = torch.compile(flex.flex_attention)(query, key, value, block_mask=compiled)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    unmasked = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    assert (unmasked - expected).abs().max() > 0.1  # the mask matters at these sizes: a wrong one shows

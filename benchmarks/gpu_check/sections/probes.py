"""The preflight's probes (:mod:`gpu_check.sections.preflight`): each GPU path of the package run once on a small
input and compared with a reference that does not share its code, in seconds, before a minute of the call is
timed with it. A probe takes the device (``"cuda"``; ``"cpu"`` for its rehearsal, where the CPU can run it) and
returns a one-line summary of what it compared; it raises :class:`ProbeFailed` (an ``AssertionError``) where the
path gives other numbers than its reference.

- :func:`triton_output_layer`: the output layer's Triton kernel (``algo.fused_output_layer=triton``) against the
  same log-probabilities computed in float64, values and gradients, at a temperature of 0.7 and with a bias, within
  :data:`FLOAT64_TOLERANCE`: a missing ``1 / T`` or a dropped bias is off by orders of magnitude more, a temperature
  0.1% off by 20 times more (float32's own error is about 1e-6); on a GPU over several blocks of rows and a
  vocabulary that ends in a short block;
- :func:`compiled_layers`: each decoder layer compiled as ``hardware.compile=layers`` compiles it (inductor, the
  GPU's backend and the CPU's) against the same model eager, loss and every gradient, then on a GPU a step in bf16
  autocast at another length;
- :func:`flex_layout`: pairs packed around their shared prompts under flex attention, with the mask
  :func:`rlhf.data.layout_masks.model_inputs` builds for it (its compiled construction on a GPU), against the same
  model under sdpa with the dense mask the same function builds: logits, and on a GPU every gradient (flex attention
  has no backward pass on a CPU);
- :func:`static_decoding`: completions of :func:`rlhf.models.generation.sample` with ``generation="static"`` (the
  static-cache decoder, its step compiled into CUDA graphs on a GPU, from a policy whose layers are compiled)
  against the same call with ``generation="transformers"`` (``model.generate``): the same tokens, greedy and sampled
  with one seed (temperature, top-k and top-p all in play).

Every probe runs in a process of its own (:mod:`gpu_check.workers.isolated`), which also fails it where torch's
compiler hit its recompile limit during it.
"""

from __future__ import annotations

FLOAT64_TOLERANCE = 1e-3  # float32 against float64: |Δ log-probability|, and |Δ gradient| / max |gradient|
# bf16 autocast, the kernel against the torch operations on the same bf16 operands: |Δ log-probability| and |Δ gradient|
# / max |gradient| (both round the products' operands alike; the logits' rounding differs); a missing 1/T is 0.3
BF16_TOLERANCE = 5e-2
EAGER_TOLERANCE = 1e-4  # float32, compiled or another attention kernel against eager: |Δ| / max(1, max |value|)
GRADIENT_TOLERANCE = 1e-3  # the same for gradients: max |Δ| / max |gradient|
TEMPERATURE = 0.7  # the Triton probe's and the sampled decoding's


class ProbeFailed(AssertionError):
    """A GPU path gave other numbers than its reference; the message says which and by how much."""


class Unavailable(ImportError):
    """What a probe needs is not on this machine (Triton on a CPU without it): on a CPU its row says so."""


def _tiny_llama(device: str, vocab: int, hidden: int, layers: int = 2, attention: str = "sdpa", seed: int = 0):
    """A float32 Llama of random weights, built from a config (no files), in eval mode on ``device``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         attn_implementation=attention)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device).eval()


def _relative(got, want) -> float:
    """max |got - want| / max(1, max |want|), in float64."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def _gradient_error(got: dict, want: dict) -> tuple[float, str]:
    """The largest gradient difference over the largest reference gradient, and the parameter where it is."""
    scale = max(float(g.abs().max()) for g in want.values()) or 1.0
    worst = {name: float((got[name].double() - want[name].double()).abs().max()) / scale for name in want}
    name = max(worst, key=worst.get)
    return worst[name], name


# ---- the output layer's Triton kernel -------------------------------------------------------------------------------
# (batch, positions, hidden, vocabulary): on a GPU 8 x 616 scored rows of a 32,003-entry vocabulary (float32 logits of
# 630 MB: three blocks of rows at rlhf.ops.linear_logps_torch's 256 MiB a block, so the weight's gradient is summed
# over blocks; the vocabulary's last block of 4,096 entries short); on a CPU (Triton's interpreter,
# TRITON_INTERPRET=1) a few rows
TRITON_SHAPES = {"cuda": (8, 620, 64, 32003), "cpu": (2, 12, 16, 300)}


def float64_logps(hidden, weight, bias, index, start: int, temperature: float):
    """log_softmax((hidden @ weight.T + bias) / temperature) at ``index`` from position ``start``, in float64."""
    import torch

    logits = torch.nn.functional.linear(hidden.double(), weight.double(), bias.double())
    scaled = logits[:, start:start + index.shape[1]] / temperature
    return scaled.log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def compare_with_float64(logps_fn, device: str, shape: tuple[int, int, int, int], temperature: float = TEMPERATURE,
                         reference_temperature: float | None = None, seed: int = 0) -> str:
    """``logps_fn(hidden, weight, bias, index, start, temperature)`` (float32 inputs) against :func:`float64_logps`:
    the log-probabilities and the gradients of hidden states, weight and bias under a random upstream gradient
    (some positions without one), each within :data:`FLOAT64_TOLERANCE`. ``reference_temperature``: the
    reference's, where it should differ (the tests' break)."""
    import torch

    batch, positions, width, vocab = shape
    start = 4
    generator = torch.Generator(device="cpu").manual_seed(seed)
    hidden0 = torch.randn(batch, positions, width, generator=generator).to(device)
    weight0 = (torch.randn(vocab, width, generator=generator) * width ** -0.5 * 3).to(device)
    bias0 = torch.randn(vocab, generator=generator).to(device)
    index = torch.randint(vocab, (batch, positions - start), generator=generator).to(device)
    upstream = torch.randn(batch, positions - start, generator=generator).to(device)
    upstream[0, :3] = 0.0  # positions without a gradient (a completion mask's zeros)
    results = []
    for fn, t in ((logps_fn, temperature), (float64_logps, reference_temperature or temperature)):
        dtype = torch.float32 if fn is logps_fn else torch.float64
        h, w, b = (x.to(dtype).clone().requires_grad_() for x in (hidden0, weight0, bias0))
        logps = fn(h, w, b, index, start, t)
        (logps * upstream.to(logps.dtype)).sum().backward()
        results.append((logps.detach(), {"hidden": h.grad, "weight": w.grad, "bias": b.grad}))
    (logps, grads), (want, want_grads) = results
    error = float((logps.double() - want).abs().max())
    gradient, where = _gradient_error(grads, want_grads)
    summary = (f"{batch * (positions - start)} rows x {vocab} entries, T={temperature}, with a bias: max |Δ logp| "
               f"{error:.1e}, max |Δ grad| / max |grad| {gradient:.1e} (tolerance {FLOAT64_TOLERANCE:g})")
    if not (error <= FLOAT64_TOLERANCE and gradient <= FLOAT64_TOLERANCE):
        raise ProbeFailed(f"differs from float64: {summary}; the worst gradient: {where}'s")
    return summary


def triton_output_layer(device: str) -> str:
    """The Triton kernel of :func:`rlhf.ops.token_logps.linear_log_softmax` against float64
    (:func:`compare_with_float64`; TF32 off: float32 products in float32)."""
    import torch

    from rlhf.ops.token_logps import linear_log_softmax, triton_kernel

    if triton_kernel() is None:
        raise Unavailable("triton does not import here (a CUDA build of torch brings it; on a CPU: TRITON_INTERPRET=1 "
                          "and triton on the path)")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False

    def kernel(h, w, b, index, start, temperature):
        return linear_log_softmax(h, w, b, index, start=start, temperature=temperature, triton=True)[0]

    return compare_with_float64(kernel, device, TRITON_SHAPES[device]) + "; " + _bf16_against_torch(device)


def _bf16_against_torch(device: str, temperature: float = 0.7) -> str:
    """Under bf16 autocast (the kernel's 16-bit products and its in-place float32 sum of the weight's gradient), the
    Triton kernel against the torch operations: log-probabilities and the gradients of the hidden states and the
    weight within :data:`BF16_TOLERANCE`."""
    import torch

    from rlhf.ops.token_logps import linear_log_softmax

    batch, positions, width, vocab = TRITON_SHAPES[device]
    generator = torch.Generator(device="cpu").manual_seed(3)
    hidden0 = torch.randn(batch, positions, width, generator=generator).to(device)
    weight0 = (torch.randn(vocab, width, generator=generator) * width ** -0.5 * 3).to(device)
    index = torch.randint(vocab, (batch, positions - 1), generator=generator).to(device)
    upstream = torch.randn(batch, positions - 1, generator=generator).to(device)
    results = []
    for triton in (True, False):
        h, w = (x.clone().requires_grad_() for x in (hidden0, weight0))
        with torch.autocast(device, dtype=torch.bfloat16):
            logps = linear_log_softmax(h, w, None, index, temperature=temperature, triton=triton)[0]
        (logps * upstream).sum().backward()
        results.append((logps.detach().float(), h.grad.float(), w.grad.float()))
    (logps, grad_h, grad_w), (want, want_h, want_w) = results
    error = float((logps - want).abs().max())
    gradient = max(float((grad_h - want_h).abs().max() / want_h.abs().max()),
                   float((grad_w - want_w).abs().max() / want_w.abs().max()))
    summary = (f"bf16 autocast against the torch operations: max |Δ logp| {error:.1e}, max |Δ grad| / max |grad| "
               f"{gradient:.1e} (tolerance {BF16_TOLERANCE:g})")
    if not (error <= BF16_TOLERANCE and gradient <= BF16_TOLERANCE):
        raise ProbeFailed(f"the kernel differs from the torch operations in bf16: {summary}")
    return summary


# ---- compiled decoder layers -----------------------------------------------------------------------------------------
def compiled_layers(device: str) -> str:
    """A Llama's decoder layers compiled as ``hardware.compile=layers`` does (:func:`rlhf.hardware.compiling.
    compile_model`) against the same weights eager: the float32 loss and every gradient; then, on a GPU, a step in
    bf16 autocast at another length (one more graph), its loss finite."""
    import copy

    import torch

    from rlhf.hardware.compiling import LAYERS, compile_model

    eager = _tiny_llama(device, vocab=512, hidden=128 if device == "cuda" else 64).train()
    eager.config.use_cache = False
    compiled = copy.deepcopy(eager)
    compile_model(compiled, LAYERS)
    ids = torch.randint(3, 512, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    results = []
    for model in (compiled, eager):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
    (loss, grads), (want, want_grads) = results
    error = _relative(loss, want)
    gradient, where = _gradient_error(grads, want_grads)
    summary = (f"loss |Δ| {error:.1e} (tolerance {EAGER_TOLERANCE:g}), max |Δ grad| / max |grad| {gradient:.1e} "
               f"(tolerance {GRADIENT_TOLERANCE:g})")
    if not (error <= EAGER_TOLERANCE and gradient <= GRADIENT_TOLERANCE):
        raise ProbeFailed(f"compiled layers differ from eager: {summary}; the worst gradient: {where}'s")
    if device != "cuda":  # a CPU's rehearsal: the bf16 step compiles twice more (tens of seconds there)
        return summary
    compiled.zero_grad()
    longer = torch.randint(3, 512, (2, 128), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = compiled(input_ids=longer, labels=longer).loss
    loss.backward()
    if not torch.isfinite(loss.detach()):
        raise ProbeFailed(f"compiled layers in bf16 autocast: loss {float(loss)}")
    return summary + "; a bf16 step at another length ran"


# ---- pairs packed around their shared prompts, under flex attention -----------------------------------------------
def packed_pairs(pairs: int, vocab: int, seed: int = 0) -> dict:
    """``pairs`` DPO pairs of random lengths (prompts of 30-150 tokens, answers of 10-90) packed into one row around
    their shared prompts (:func:`rlhf.data.shared_prompt.collate_packed`): blocks of 128 positions that no query
    sees (another pair's, the other answer's) are many."""
    import random

    from rlhf.data.shared_prompt import collate_packed

    rng = random.Random(seed)
    chosen, chosen_masks, rejected, rejected_masks = [], [], [], []
    for _ in range(pairs):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(30, 150))]
        for ids, masks in ((chosen, chosen_masks), (rejected, rejected_masks)):
            answer = [rng.randrange(3, vocab) for _ in range(rng.randint(10, 90))]
            ids.append(prompt + answer)
            masks.append([0] * len(prompt) + [1] * len(answer))
    return collate_packed(chosen, chosen_masks, rejected, rejected_masks)


def compare_attention(device: str, backward: bool, pairs: int = 6, reference_mask=None) -> str:
    """The same weights under flex attention and under sdpa on :func:`packed_pairs`, each with the mask
    :func:`rlhf.data.layout_masks.model_inputs` builds for its attention (a ``BlockMask``; a dense boolean mask):
    logits within :data:`EAGER_TOLERANCE` and, with ``backward``, every gradient within :data:`GRADIENT_TOLERANCE`.
    ``reference_mask(batch)``: the sdpa side's mask instead (the tests' break)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    from rlhf.data import layout_masks

    vocab = 512
    width = 128 if device == "cuda" else 64  # heads of 32 on a GPU (flex attention's kernels want 16 or more)
    flex = _tiny_llama(device, vocab=vocab, hidden=width, attention="flex_attention")
    dense = _tiny_llama(device, vocab=vocab, hidden=width, attention="sdpa")
    dense.load_state_dict(flex.state_dict())
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed_pairs(pairs, vocab).items()}
    results, sparsity = [], None
    for model in (flex, dense):
        inputs = layout_masks.model_inputs({**batch}, model)
        if model is flex:
            mask = inputs["attention_mask"]
            if not isinstance(mask, BlockMask):
                raise ProbeFailed(f"model_inputs gave flex attention a {type(mask).__name__}, not a BlockMask")
            sparsity = float(mask.sparsity())
        elif reference_mask is not None:
            inputs["attention_mask"] = reference_mask(batch)
        with torch.set_grad_enabled(backward):
            logits = model(input_ids=batch["input_ids"], **inputs).logits
        if backward:
            logits.float().logsumexp(-1).mean().backward()
        results.append((logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                        if backward else {}))
    (logits, grads), (want, want_grads) = results
    error = _relative(logits, want)
    summary = (f"{pairs} pairs packed into {batch['input_ids'].shape[1]} positions, {sparsity:.0f}% of the mask's "
               f"blocks skipped: logits |Δ| {error:.1e} (tolerance {EAGER_TOLERANCE:g})")
    ok = error <= EAGER_TOLERANCE
    if backward:
        gradient, where = _gradient_error(grads, want_grads)
        summary += f", max |Δ grad| / max |grad| {gradient:.1e} (tolerance {GRADIENT_TOLERANCE:g}, worst: {where})"
        ok = ok and gradient <= GRADIENT_TOLERANCE
    else:
        summary += "; forward only (flex attention has no backward pass on a CPU)"
    if not ok or sparsity <= 0.0:
        raise ProbeFailed(f"flex attention with layout_masks' block mask differs from sdpa with its dense mask, or "
                          f"skips no block: {summary}")
    return summary


def flex_layout(device: str) -> str:
    """:func:`compare_attention` with the backward pass where the device has one for flex attention (a GPU)."""
    return compare_attention(device, backward=device == "cuda")


# ---- static-cache decoding against transformers' generate ------------------------------------------------------------
DECODING_SAMPLING = {"temperature": TEMPERATURE, "top_k": 40, "top_p": 0.9}
DECODING_NEW_TOKENS = 24
DECODING_EOS = tuple(range(2, 300, 23))  # 13 of the 300 tokens end a completion: rows end at different lengths


def decoding_policy(device: str, layers_compiled: bool):
    """The decoding probes' policy: a float32 Llama whose output layer is scaled up (its greedy choices clear by far
    more than float32's rounding between kernels; sampling still spread over several tokens at temperature 0.7),
    with each decoder layer compiled as ``hardware.compile=layers`` does where ``layers_compiled``."""
    import torch

    from rlhf.hardware.compiling import LAYERS, compile_model

    model = _tiny_llama(device, vocab=300, hidden=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    if layers_compiled:
        compile_model(model, LAYERS)
        model.config.use_cache = True  # compile_model turns it off for training's forward passes
    return model


def decoded(model, device: str, generation: str, seed: int | None, sampling: dict | None = None,
            num_generations: int = 2) -> dict:
    """:func:`rlhf.models.generation.sample` of three left-padded prompts (5, 9 and 17 tokens) with ``generation``:
    its completion ids and mask."""
    import torch

    from rlhf.models.generation import Sampling, sample
    from rlhf.models.tokenizer import byte_tokenizer

    generator = torch.Generator().manual_seed(3)
    lengths, width = (5, 9, 17), 17
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, 259, (length,), generator=generator)
        mask[row, width - length:] = 1
    settings = Sampling(max_new_tokens=DECODING_NEW_TOKENS, pad_id=0, eos_ids=DECODING_EOS, tokenizer=byte_tokenizer(),
                        generation=generation, **(sampling or {}))
    out = sample(model, ids.to(device), mask.to(device), num_generations, seed, settings)
    return {"ids": out["completion_ids"].cpu(), "mask": out["completion_mask"].cpu()}


def compare_decoders(model, device: str, reference_sampling: dict | None = None) -> str:
    """The static decoder's completions against transformers' ``generate``'s, greedy and sampled with one seed:
    equal token for token. ``reference_sampling``: ``generate``'s sampling settings where they should differ (the
    tests' break)."""
    import torch

    checks = []
    for what, seed in (("greedy", None), ("sampled, seed 7", 7)):
        static = decoded(model, device, "static", seed, DECODING_SAMPLING)
        reference = decoded(model, device, "transformers", seed, reference_sampling or DECODING_SAMPLING)
        same = static["ids"].shape == reference["ids"].shape and torch.equal(static["ids"], reference["ids"]) \
            and torch.equal(static["mask"], reference["mask"])
        if not same:
            width = min(static["ids"].shape[1], reference["ids"].shape[1])
            differ = (static["ids"][:, :width] != reference["ids"][:, :width]).nonzero()
            where = f"first at row {int(differ[0, 0])}, token {int(differ[0, 1])}" if len(differ) else \
                f"lengths {static['ids'].shape[1]} and {reference['ids'].shape[1]}"
            raise ProbeFailed(f"static decoding ({what}) gave other tokens than transformers' generate: {where}")
        checks.append(f"{what}: {int(static['mask'].sum())} tokens equal")
    return "; ".join(checks) + f" ({', '.join(f'{k}={v}' for k, v in DECODING_SAMPLING.items())})"


def static_decoding(device: str) -> str:
    """:func:`compare_decoders` on :func:`decoding_policy` with compiled layers on a GPU (as a GRPO run with
    ``hardware.compile=layers`` and ``algo.generation=static`` decodes) and eager ones on a CPU."""
    return compare_decoders(decoding_policy(device, layers_compiled=device == "cuda"), device)

"""The GPU check's dated page and summary: the goals judged from what was measured, then each section's table."""

from __future__ import annotations

from gpu_check.page.defaults import defaults_lines
from gpu_check.plan import GOALS
from gpu_check.sections.correctness import CHECKPOINT_STEPS
from gpu_check.sections.speed import MEMORY_CASE, ratio_cell


def _reads(row: dict, case: str, shape: str) -> bool:
    return (case == "*" or row["case"] == case) and (shape == "*" or row.get("shape", "short") == shape)


def goals(data: dict) -> list[tuple[str, str, str]]:
    """``(goal, measured, verdict)`` rows: each goal over every speed row it reads."""
    out = []
    for name, (case, shape), test in GOALS:
        rows = [r for r in data["speed"] if _reads(r, case, shape)]
        if "best options" in name and any(r.get("ratio_best") is None for r in rows):
            why = "; ".join(f"{r['size']} b{r['batch']} {r['case']}: {r.get('trl_best_why') or 'not run'}"
                            for r in rows if r.get("ratio_best") is None)
            out.append((name, f"not measured ({why})"[:400], "not measured"))
            continue
        if not rows:
            out.append((name, "not measured", "not measured"))
            continue
        if "memory" in name:
            shown = "; ".join(f"{r['size']} b{r['batch']} {r['case']} {r.get('shape', 'short')} "
                              f"{r['ours']['peak_mem_mb']:.0f} vs {r['trl']['peak_mem_mb']:.0f} MB" for r in rows)
        else:
            best = "best options" in name
            shown = "; ".join(f"{r['size']} b{r['batch']}{'' if case != '*' else ' ' + r['case']} "
                              f"{ratio_cell(r, best).replace('**', '')}" for r in rows)
        out.append((name, shown, "met" if all(test(r) for r in rows) else "NOT met"))
    mfu = [r for r in data["speed"] if r["case"] == "dpo_bf16" and r["size"] == "1b" and r.get("shape") == "real"]
    best = max(mfu, key=lambda r: r["ours"]["mfu"]) if mfu else None
    out.append(("bf16 MFU, DPO at ~1B, real lengths ≥ 40%",
                f"{best['ours']['mfu']:.1%} (batch {best['batch']})" if best else "not measured",
                ("met" if best["ours"]["mfu"] >= 0.4 else "NOT met") if best else "not measured"))
    cost = data["checkpoint"]
    out.append(("a checkpoint at the default interval, batch 8 ≤ 2% of training",
                f"{cost['share']:.2%}" if cost else "not measured",
                ("met" if cost["share"] <= 0.02 else "NOT met") if cost else "not measured"))
    return out


def _verdict(ok) -> str:
    return "n/a" if ok is None else "yes" if ok else "**NO**"


def speed_lines(data: dict) -> list[str]:
    lines = ["", "## Speed and memory against TRL (equal settings), and TRL with its best options", "",
             "| size | batch | case | rows | steps timed | rlhf samples/s | TRL samples/s | rlhf / TRL | "
             "TRL best samples/s | rlhf / TRL best | MFU rlhf | MFU TRL | peak MB rlhf | peak MB TRL | peak MB TRL best |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["speed"]:
        best = r.get("trl_best")
        best_speed = f"{best['samples_per_s']:.1f}" if best else f"not run: {r.get('trl_best_why', '-')}"
        best_memory = f"{best['peak_mem_mb']:.0f}" if best else "-"
        notes = [f"{side}: a compile in window(s) {', '.join(str(k + 1) for k, n in enumerate(counts) if n)}"
                 for side, counts in r.get("compiles", {}).items() if any(counts)]
        notes += ["sides one after another (memory)"] if r.get("blocks") else []
        shown_case = r["case"] + (f" ({'; '.join(notes)})" if notes else "")
        lines.append(f"| {r['size']} ({r['params'] / 1e6:.0f}M) | {r['batch']} | {shown_case} | {r.get('shape', 'short')} "
                     f"| {r['steps']} | {r['ours']['samples_per_s']:.1f} | {r['trl']['samples_per_s']:.1f} | "
                     f"{ratio_cell(r)} | {best_speed} | {ratio_cell(r, best=True)} | {r['ours']['mfu']:.1%} | "
                     f"{r['trl']['mfu']:.1%} | {r['ours']['peak_mem_mb']:.0f} | {r['trl']['peak_mem_mb']:.0f} | "
                     f"{best_memory} |")
    for s in data["skipped"]:
        lines.append(f"| {s['size']} | {s['batch']} | {s['case']}{' ' + s['lever'] if 'lever' in s else ''} | "
                     f"{s.get('shape', '')} | not run: {s['why']} | | | | | | | | | | |")
    return lines


def profile_lines(profile: dict) -> list[str]:
    p = profile
    lines = ["", f"## Profile ({p['size']}, batch {p['batch']}, {p['case']}, {p['shape']} rows: {p['steps']} steps "
             "of each side under torch.profiler)", "",
             "| side | ms per step (profiler on) | GPU busy ms | window ms | GPU idle share |", "|---|---:|---:|---:|---:|"]
    for side in ("rlhf", "TRL"):
        s = p[side]
        idle = "no GPU events" if s["idle_share"] is None else f"{s['idle_share']:.1%}"
        lines.append(f"| {side} | {s['ms_per_step']:.1f} | {s['busy_ms']:.1f} | {s['span_ms']:.1f} | {idle} |")
    lines += ["", "| side | kernel | calls | total ms | share of GPU busy time |", "|---|---|---:|---:|---:|"]
    for side in ("rlhf", "TRL"):
        for k in p[side]["kernels"]:
            name = k["name"].replace("|", "/")[:90]
            lines.append(f"| {side} | `{name}` | {k['calls']} | {k['ms']:.2f} | {k['share']:.1%} |")
        if not p[side]["kernels"]:
            lines.append(f"| {side} | (no GPU kernels in the trace) | | | |")
    return lines


def page(data: dict) -> str:
    h = data["header"]
    lines = [f"# GPU check, {h['date']}: {h['machine']}", "",
             f"Measured {h['date']} on {h['machine']}; {h['versions']}. Command: `{h['command']}` "
             f"({h['elapsed_s']:.0f} s of a {h['budget_s']} s budget; the plan's estimate "
             f"{h.get('plan_estimate_s', 0):.0f} s). Peak matrix-product rates measured in the run: "
             + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in data["peaks"].items()) + ".", "",
             "## Goals", "", "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {v} |" for g, m, v in goals(data)]
    lines += ["", "## Correctness", "", "| check | measured | within tolerance |", "|---|---|---|"]
    lines += [f"| {c['check']} | {c['value']} | {_verdict(c['ok'])} |" for c in data["correctness"]]
    lines += speed_lines(data)
    if data.get("profile"):
        lines += profile_lines(data["profile"])
    if data["levers"]:
        lines += ["", "## Levers (ours only, against our defaults on the same case)", "",
                  "| size | batch | case | rows | lever | overrides | samples/s | × defaults' speed | peak MB | "
                  "× defaults' memory |", "|---|---:|---|---|---|---|---:|---:|---:|---:|"]
        for r in data["levers"]:
            lines.append(f"| {r['size']} | {r['batch']} | {r['case']} | {r.get('shape', 'short')} | {r['lever']} | "
                         f"`{' '.join(r['overrides'])}` | {r['ours']['samples_per_s']:.1f} | {r['speed']:.2f} | "
                         f"{r['ours']['peak_mem_mb']:.0f} | {r['memory']:.2f} |")
    lines += defaults_lines(data["levers"])  # what the levers say of each auto default (rlhf/core/auto_choices.py)
    if data["kernels"]:
        lines += ["", "## The output layer's log-probabilities (SFT's loss, forward and backward)", "",
                  "| shape | way | ms | peak MB | loss error |", "|---|---|---:|---:|---:|"]
        for k in data["kernels"]:
            lines.append(f"| {k['shape']} | {k['way']} | not run: {k['failed']} | | |" if "failed" in k else
                         f"| {k['shape']} | {k['way']} | {k['ms']:.2f} | {k['peak_mb']:.0f} | {k['loss_error']:.1e} |")
    if data.get("memory"):
        lines += ["", f"## Memory at the peak ({' '.join(str(x) for x in MEMORY_CASE)}, one profiled step)", ""]
        for side, text in data["memory"].items():
            lines += [f"{side}:", "", "```", text.rstrip(), "```", ""]
    cost = data["checkpoint"]
    if cost:
        lines += ["", f"Checkpoint (DPO as shipped, batch {cost['batch']}): {cost['checkpoint_s']:.2f} s against a "
                  f"{cost['step_s']:.3f} s step: {cost['share']:.2%} of training at the default interval (one every "
                  f"{cost['interval_minutes']:g} minutes, `train.save_every_minutes`), "
                  f"{cost['share_every_100_steps']:.2%} at one every {CHECKPOINT_STEPS} steps."]
    lines += ["", "Rows: `real` is prompts of up to 256 tokens and completions of up to 384 (GRPO: 128 new tokens), "
              "most rows short with a tail to the maximum; `short` is 32 + 32 (a step there is mostly kernel "
              "launches). GRPO's samples are completions (8 a prompt); its MFU counts the trained tokens only "
              "(6 x parameters each), not the generation's forward passes. Each side runs in a process of its own "
              "that lives for the whole call: per pair it builds its side and trains a few untimed steps, then the "
              "sides are timed by turns (rlhf, TRL, TRL best, rlhf, ...), one window of the steps shown per turn, its "
              "ends waiting for the GPU; each side's median window is the row (its samples/s, MFU and memory), the "
              "ratio being the medians' with the range of the rounds' ratios beside it. TRL best: TRL's own options "
              "for one GPU (`use_liger_kernel=True`; TRL 1.16's DPO has no working padding-free mode, and its SFT "
              "padding-free mode is documented for FlashAttention only)."]
    if data.get("fallbacks"):
        lines += ["", "Preflight: our side ran with " + ", ".join(f"`{o}`" for o in data["fallbacks"])
                  + " in every pair and lever of this call (the default failed its preflight: see Correctness)."]
    return "\n".join(lines) + "\n"


def summary(data: dict) -> str:
    rows = goals(data) + [(c["check"], c["value"], {None: "n/a", True: "ok", False: "FAILED"}[c["ok"]])
                          for c in data["correctness"]]
    width = max(len(g) for g, _, _ in rows)
    return "\n".join(f"{g:<{width}}  {v:<13}  {m}" for g, m, v in rows)

"""What each optimizer of ``conf/optimizer/`` costs on one model: its state's bytes per trainable parameter after a
step, and the time of one ``optimizer.step()`` as a ratio to AdamW's (``optimizer=adamw``) on the same model.

    python benchmarks/optimizer_costs.py                          # the embedded default's model (python train.py)
    python benchmarks/optimizer_costs.py --model smollm2-135m     # the packaged real model (conf/model/smollm2-135m.yaml)
    python benchmarks/optimizer_costs.py --out costs.json --out costs.md   # the table as JSON and as markdown too

The options are the files of ``conf/optimizer/`` found when it runs. Each is built as a run builds it
(``rlhf/run/components.py``): the config composed with ``optimizer=<option>``, the model from ``cfg.model``, the
partition and the optimizer's partial from ``rlhf.optim.partition.from_config``, then ``split.build(make_optimizer)``.
An option whose library is not installed is reported as such and the others go on.

Every trainable parameter gets a fixed random gradient (the same for every option), set again before each step
and outside the timer (heavyball clears ``p.grad`` inside ``step()``). Measured:

- **state**: the bytes of every tensor in ``optimizer.state`` after one step (nested dicts, lists and tuples
  included; a tensor seen twice, or a view of one, counted once), per trainable parameter, split by dtype: an 8-bit
  optimizer's ``uint8`` codes beside the ``float32`` scales and the tensors too small to quantize.
- **step time**: per round, ``--warmup`` untimed steps then the median of ``--steps`` timed ones; ``--rounds``
  rounds, each building every option afresh in turn (so that a busy spell of the machine falls on all options
  alike). The figure is the median over rounds, its spread the lowest and highest round; the ratio is to AdamW's
  figure. Threads: ``--threads`` (``torch.set_num_threads``), fixed for the whole measurement.

``--variant OPTION OVERRIDE...`` adds a row for an option with overrides (as on train.py's command line), e.g.
``--variant muon optimizer.ns_dtype=bfloat16``: torch's own bfloat16 Newton-Schulz beside the float32 one that
``ns_dtype: auto`` takes on a CPU without bf16 matrix units. Muon's step eager against compiled is
``benchmarks/muon_compile.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
REFERENCE = "adamw"  # the option every step time is divided by


def options(wanted: list[str] | None) -> list[str]:
    """The options of conf/optimizer/ (the reference first), or those of ``wanted`` that exist."""
    found = sorted(path.stem for path in (CONF / "optimizer").glob("*.yaml"))
    chosen = [name for name in found if wanted is None or name in wanted]
    unknown = sorted(set(wanted or ()) - set(found))
    if unknown:
        sys.exit(f"not options of conf/optimizer/: {', '.join(unknown)} (there: {', '.join(found)})")
    return sorted(chosen, key=lambda name: name != REFERENCE)


def compose(*overrides: str):
    """The config ``python train.py <overrides>`` composes."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=[*overrides, "output_dir=unused"])


def build_model(model_option: str | None) -> torch.nn.Module:
    """The policy model of the run ``python train.py [model=<option>]`` (the embedded default: its warm-started tiny
    Llama, built once and cached in RLHF_CACHE; smollm2-135m: the packaged GGUF's Hugging Face folder)."""
    from rlhf.core.instantiate import build

    cfg = compose(*([f"model={model_option}"] if model_option else []))
    return build(cfg.model).model


def build_optimizer(option: str, model: torch.nn.Module, model_option: str | None, overrides: tuple[str, ...] = ()):
    """(split, optimizer) of ``optimizer=<option> <overrides>`` for ``model``, as rlhf/run/components.py builds
    them."""
    from rlhf.optim import partition as partitions

    cfg = compose(f"optimizer={option}", *overrides, *([f"model={model_option}"] if model_option else []))
    partition, make_optimizer = partitions.from_config(cfg.optimizer)
    split = partition(model)
    return split, split.build(make_optimizer)


def why_not(error: BaseException) -> dict[str, str]:
    """An option that could not be built or stepped: a missing library (an ImportError anywhere in the chain of
    causes: a UserError raised from the ImportError) or the error itself."""
    chain, seen = error, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, ImportError):
            return {"status": "library missing", "detail": f"{error}" if chain is not error else f"{chain}"}
        chain = chain.__cause__ or chain.__context__
    return {"status": "error", "detail": f"{type(error).__name__}: {error}"}


def libraries(optimizer: torch.optim.Optimizer) -> list[str]:
    """The library classes that step the parameters (an optimizer of several rules: each rule's,
    rlhf.optim.rules.PerRule; a wrapper of this project: the library class it subclasses) and the version of the
    distribution each comes from."""
    inner = list(getattr(optimizer, "rules", {}).values()) or [optimizer]
    distributions = importlib.metadata.packages_distributions()
    named = []
    for obj in inner:
        # this project's wrapper (rlhf.optim.*) subclasses the library's class: name the library's
        cls = next((c for c in type(obj).__mro__ if c.__module__.split(".")[0] != "rlhf"), type(obj))
        top = cls.__module__.split(".")[0]
        dist = (distributions.get(top) or [top])[0]
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        named.append(f"{cls.__module__}.{cls.__qualname__} ({dist} {version})")
    return named


def state_bytes(state: Any) -> dict[str, int]:
    """Bytes of every tensor in ``state`` (an optimizer's ``state``: nested dicts, lists, tuples), by dtype: the
    memory each holds (its storage), so that a tensor reachable twice, or a view of one, counts once."""
    by_dtype: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()  # the memory held: a view shares its tensor's
            key = (storage.data_ptr(), storage.nbytes())
            if key in seen:
                continue
            seen.add(key)
            name = str(item.dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
    return by_dtype


def fixed_gradients(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """One random gradient per trainable parameter (standard normal x 1e-3), the same for every option."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=generator, dtype=p.dtype) * 1e-3
            for name, p in model.named_parameters() if p.requires_grad}


def set_gradients(model: torch.nn.Module, gradients: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        if name in gradients:
            p.grad = gradients[name].clone()


def timed_steps(model, gradients, step, warmup: int, steps: int, budget_s: float = float("inf")) -> tuple[list[float], float]:
    """(seconds of each of up to ``steps`` timed calls of ``step``, seconds of the first call), ``warmup`` untimed
    calls (the first among them) before; the gradients set again before every call, outside the timer. Past
    ``budget_s`` seconds of calls, warm-up and timed calls stop (one timed call at least): a step of minutes
    (torch's Muon in bfloat16 on a CPU without bfloat16 matrix units) is measured fewer times, not skipped."""
    first, spent = 0.0, 0.0
    for i in range(warmup):
        if spent > budget_s:
            break
        set_gradients(model, gradients)
        start = time.perf_counter()
        step()
        spent += time.perf_counter() - start
        if i == 0:
            first = spent
    times: list[float] = []
    for _ in range(steps):
        if times and spent > budget_s:
            break
        set_gradients(model, gradients)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return times, first


def label(option: str, overrides: tuple[str, ...]) -> str:
    """A row's name: the option, and its overrides in brackets."""
    return f"{option} ({' '.join(overrides)})" if overrides else option


def measure(runs: list[tuple[str, tuple[str, ...]]], model, model_option, gradients, initial, args) -> list[dict[str, Any]]:
    """One row per (option, overrides): the state after one step and the step time over ``args.rounds`` rounds."""
    trainable = sum(g.numel() for g in gradients.values())
    rows = {label(*run): {"option": label(*run)} for run in runs}
    for round_ in range(args.rounds):
        for name, overrides in runs:
            row = rows[label(name, overrides)]
            if "status" in row and row["status"] != "ok":
                continue
            model.load_state_dict(initial)  # every option starts from the same weights
            try:
                split, optimizer = build_optimizer(name, model, model_option, overrides)
                if round_ == 0:
                    set_gradients(model, gradients)
                    optimizer.step()
                    by_dtype = state_bytes(optimizer.state)
                    row.update(status="ok", classes=libraries(optimizer), partition=split.kind.rsplit(".", 1)[-1],
                               parts={part.name: sum(p.numel() for p in part.params) for part in split.parts},
                               state_bytes=by_dtype, state_bytes_per_parameter=sum(by_dtype.values()) / trainable,
                               step_s=[])
                times, _ = timed_steps(model, gradients, optimizer.step, args.warmup, args.steps, args.budget_s)
                row.setdefault("timed_steps", []).append(len(times))
            except Exception as error:  # reported in the table; the other options go on
                row.update(why_not(error))
                continue
            finally:
                for p in model.parameters():
                    p.grad = None
            row["step_s"].append(statistics.median(times))
            del optimizer
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    reference = rows.get(REFERENCE, {}).get("step_s")
    for row in rows.values():
        if row.get("status") == "ok":
            row["step_ms"] = 1000 * statistics.median(row["step_s"])
            row["step_ms_range"] = [1000 * min(row["step_s"]), 1000 * max(row["step_s"])]
            if reference:
                row["vs_adamw"] = row["step_ms"] / (1000 * statistics.median(reference))
    return list(rows.values())


def machine() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    start, end = (", ".join(f"{value:.2f}" for value in report[key]) for key in ("load_average", "load_average_end"))
    lines = [f"Measured {report['date']} on {report['machine']} ({os.cpu_count()} CPUs; load average over 1, 5, 15 "
             f"minutes: {start} at the start, {end} at the end), torch {report['torch']}, {report['threads']} "
             f"thread(s); model: {report['model']} ({report['trainable_parameters']:,} trainable parameters); "
             f"`{report['command']}`", "",
             "| option | partition | state bytes / parameter | state by dtype | step ms (range over rounds) | "
             "step time vs adamw | classes (library version) |", "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if row.get("status") != "ok":
            lines.append(f"| {row['option']} | - | - | - | - | - | {row['status']}: {row['detail'][:160]} |")
            continue
        dtypes = ", ".join(f"{dtype} {count / report['trainable_parameters']:.2f}"
                           for dtype, count in sorted(row["state_bytes"].items()))
        low, high = row["step_ms_range"]
        ratio = f"{row['vs_adamw']:.2f}" if "vs_adamw" in row else "-"
        lines.append(f"| {row['option']} | {row['partition']} | {row['state_bytes_per_parameter']:.2f} | {dtypes} | "
                     f"{row['step_ms']:.2f} ({low:.2f}-{high:.2f}; {sum(row['timed_steps'])} steps) | {ratio} | "
                     f"{'; '.join(row['classes'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default=None, help="a conf/model option (default: the embedded default's model)")
    parser.add_argument("--only", nargs="+", default=None, help="these conf/optimizer options only (adamw is "
                        "added: the ratios are to it)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every step (default 1)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones, each round")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (their median is the round's)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every option (the spread is theirs)")
    parser.add_argument("--budget-s", type=float, default=60.0, help="seconds of steps per option and round past "
                        "which its warm-up and timed steps stop (one timed step at least)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fixed random gradients")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="OPTION OVERRIDE",
                        help="also this option with these overrides, e.g. --variant muon optimizer.ns_dtype=bfloat16 "
                        "(repeatable)")
    parser.add_argument("--out", action="append", default=[], help="write the report to this file: .json or .md "
                        "(repeatable)")
    args = parser.parse_args(argv)
    for out in args.out:
        if Path(out).suffix not in (".json", ".md"):
            parser.error(f"--out {out}: a .json or .md file")
    torch.set_num_threads(args.threads)
    names = options(None if args.only is None else sorted({*args.only, REFERENCE}))
    runs = [(name, ()) for name in names] + [(variant[0], tuple(variant[1:])) for variant in args.variant]
    options([variant[0] for variant in args.variant])  # an unknown option's name: said before anything loads
    model = build_model(args.model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    gradients = fixed_gradients(model, args.seed)
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "machine": machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
        "model": args.model or "embedded default (tiny)",
        "trainable_parameters": sum(g.numel() for g in gradients.values()),
        "command": " ".join(["python benchmarks/optimizer_costs.py", *(argv if argv is not None else sys.argv[1:])]),
        "rows": measure(runs, model, args.model, gradients, initial, args)}
    report["load_average_end"] = list(os.getloadavg())
    text = markdown(report)
    print(text)
    for out in args.out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n" if out.endswith(".json") else text)
    return report


if __name__ == "__main__":
    main()

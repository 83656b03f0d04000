"""Every option under conf/ composes, passes the config checks and builds what can be built offline.

Options are discovered by walking conf/ recursively, so a new YAML file is tested without editing this file. Each
kind of option has its own test, named after what it checks:

- components (algorithms, optimizers, schedules, hardware, loggers, the tiny model, the embedded data): built, and
  used once (an optimizer step, a few schedule steps, ...);
- Hub model presets: checked against ``load_policy`` but not downloaded (tests run offline); offline and not in the
  cache, they stop with the one-line message naming the id;
- Hub data presets: their ``DataSource`` is built (building reads nothing); loading, which downloads, is not run;
- launchers: ``hydra.launcher`` is built as Hydra builds it for ``-m``; the submitit ones are run up to the point
  where they would submit the jobs, so submitit has accepted every field;
- experiments: a sweep (``hydra.mode: MULTIRUN``) is expanded into its points, as Hydra's basic sweeper does; each
  point composes, passes the checks and builds what it sweeps. The first point (or the single run) trains 2 steps.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import datasets
import pytest
import submitit
import torch
from hydra import compose, initialize_config_dir
from hydra._internal.callbacks import Callbacks
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, RunMode
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from rlhf import train
from rlhf.algos.base import Algorithm
from rlhf.config.checks import check_config, check_fields
from rlhf.core import hub
from rlhf.core.errors import UserError
from rlhf.core.instantiate import build
from rlhf.data.source import DataSource
from rlhf.models.loading import DTYPES, load_policy
from rlhf.optim import partition as partitions
from rlhf.optim import schedule
from rlhf.run.train_settings import TrainSettings
from rlhf.sweeps.bench.plan import Bench
from rlhf.telemetry.loggers import Loggers
from tests.conftest import CONF, FAST, compose_config

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
# A folder inside a group is a group of its own (algo/reference): chosen as `algo/reference=copy`.
OPTIONS = [(str(f.parent.relative_to(CONF)), f.stem) for g in GROUPS for f in sorted((CONF / g).rglob("*.yaml"))]


def _sets(group: str, option: str, key: str) -> bool:
    """Whether the option's own YAML sets `key` (a Hub id for model.name_or_path, data.path)."""
    return OmegaConf.load(CONF / group / f"{option}.yaml").get(key) is not None


HUB_MODELS = [o for g, o in OPTIONS if g == "model" and _sets(g, o, "name_or_path")]
HUB_DATA = [o for g, o in OPTIONS if g == "data" and _sets(g, o, "path")]
LAUNCHERS = [o for g, o in OPTIONS if g == "launcher"]
EXPERIMENTS = [o for g, o in OPTIONS if g == "experiment"]
COMPONENTS = [(g, o) for g, o in OPTIONS if g not in ("launcher", "experiment")
              and not (g == "model" and o in HUB_MODELS) and not (g == "data" and o in HUB_DATA)]

# The hydra Launcher each launcher option must build (by name: Hydra loads plugins as modules of their own). The
# submitit ones are the project's (hydra_plugins/rlhf_launchers.py: a point whose process dies is a failed point).
LAUNCHER_CLASSES = {"local": "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
                    "submitit_local": "hydra_plugins.rlhf_launchers.LocalLauncher",
                    "slurm": "hydra_plugins.rlhf_launchers.SlurmLauncher"}


def test_every_group_has_options():
    assert {"algo", "model", "data", "optimizer", "scheduler", "hardware", "launcher", "logger", "experiment"} <= set(GROUPS)
    for group in GROUPS:
        assert any(g == group for g, _ in OPTIONS), f"conf/{group}/ has no option"


def _small_model():
    from rlhf.embedded.tiny_model import TinySpec

    return TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build().model


def _tok():
    from rlhf.models.tokenizer import byte_tokenizer

    return byte_tokenizer()


def _tiny_policy():
    from rlhf.embedded.tiny_model import TinySpec

    return TinySpec(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, warm_start_steps=0).build()


def _build(group: str, cfg: DictConfig, tmp_path) -> None:
    """Build the component `cfg` selects for `group` and use it once (Hub presets: what is checked offline)."""
    node = OmegaConf.select(cfg, group.replace("/", "."))
    if group == "algo/reference":  # builds the reference of a 2-layer policy, frozen (or none)
        policy = _tiny_policy()
        if "peft" in cfg and instantiate(cfg.peft).adapts:  # adapter, ref_adapter: the policy has its own adapter
            policy.model = instantiate(cfg.peft).apply(policy.model)
        reference = instantiate(node)(policy.model, policy.tokenizer)
        assert reference is None or not any(p.requires_grad for p in reference.parameters())
    elif group == "optimizer":  # with its partition (optimizer.partition; absent: matrices decayed, vectors not)
        model = _small_model()
        partition, make = partitions.from_config(node)
        optimizer = partition(model).build(make)  # with what the partition tells the optimizer (Adam-mini's dims)
        before = next(model.parameters()).detach().clone()
        for _ in range(3):  # SOAP's first step only starts its preconditioner's statistics
            model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert not torch.equal(before, next(model.parameters()))
    elif group == "scheduler":
        optimizer = torch.optim.SGD(_small_model().parameters(), lr=1.0)
        scheduler = schedule(instantiate(node), optimizer, cfg.train.max_steps)  # as the loop builds it
        lrs = []
        for _ in range(cfg.train.max_steps):
            optimizer.step()
            scheduler.step()
            lrs.append(scheduler.get_last_lr()[0])
        assert all(0.0 <= lr <= 1.0 for lr in lrs) and len(set(lrs)) > 1
        if "num_training_steps" in node:  # null: the schedule ends exactly with the run
            assert node.num_training_steps is None and lrs[-1] == 0.0 and lrs[-2] > 0.0
    elif group == "algo/reward_funcs" and "reward_model" in node:  # a saved model: one float each
        scores = instantiate(node.reward_model)(prompts=["abc=", "abc="], completions=["cba", "abc"])
        assert len(scores) == 2 and all(math.isfinite(s) for s in scores)
    elif group == "algo/reward_funcs":  # each function scores a right and a wrong answer of the task it fits
        for fn in instantiate(node).values():
            fits = getattr(getattr(fn, "func", fn), "fits_prompt", None)
            prompt, right, wrong = "abc=", "cba", "abc"
            if fits is not None and not fits(prompt):  # another task's reward: the sums task's
                prompt, right, wrong = "What is 37 + 48? Reply with the number only.", "85", "58"
            scores = fn(prompts=[prompt, prompt], completions=[right, wrong])
            assert scores[0] == 1.0 and scores[1] != 1.0
    elif group == "algo/kl_controller":  # PPO's coefficient, checkpointed
        controller = instantiate(node)
        assert controller.value > 0 and instantiate(cfg.algo).kl_controller.value == controller.value
    elif group in ONLINE_GROUPS:  # a function of the algorithm: the algorithm built from the config holds this one
        algo = instantiate(cfg.algo)
        held = getattr(algo, group.removeprefix("algo/"))
        assert getattr(held, "func", held) is get_object(node._target_) and algo.columns == ("prompt",)
    elif group == "algo":
        algo = instantiate(node)
        assert set(algo.columns) >= {"prompt"} and type(algo).loss is not Algorithm.loss  # its own loss
    elif group == "hardware":
        if node.num_nodes > 1 and node.rdzv_endpoint is None:  # multinode: says what every machine needs
            with pytest.raises(UserError, match="rdzv_endpoint=<main machine>:<port>"):
                build(node)
            node.rdzv_endpoint = "127.0.0.1:29500"
        strategy = build(node)
        assert strategy.processes_per_node() >= 1 and strategy.num_nodes >= 1
        if strategy.uses_cuda() and not torch.cuda.is_available():
            with pytest.raises(UserError, match="sees no GPU"):  # refuses; never silently runs on the CPU
                strategy.start()
        elif strategy.processes_per_node() * strategy.num_nodes == 1:
            assert strategy.start().device.type in ("cpu", "cuda")
    elif group == "logger":
        tmp_path.mkdir(parents=True, exist_ok=True)
        logger = Loggers([instantiate(one) for one in node.values()])  # as the loop builds them
        logger.start(str(tmp_path), {"a": 1})
        logger.log({"train/loss": 1.5}, step=3)
        logger.finish()
        assert '"train/loss": 1.5' in (tmp_path / "metrics.jsonl").read_text()
    elif group == "model" and node.name_or_path is not None:
        _check_hub_model(node)
    elif group == "model":
        policy = instantiate(node, tiny={"warm_start_steps": 0})
        assert policy.tokenizer.eos_token_id is not None
    elif group == "data" and node.path is not None:
        _check_hub_data(node)
    elif group == "data":
        splits = instantiate(node, task={"num_train": 8, "num_eval": 4}).load(("prompt", "completion"), _tok())
        assert len(splits["train"]) == 8
    elif group == "train":
        TrainSettings(**OmegaConf.to_container(node, resolve=True))
    elif group == "eval":  # set up on the embedded policy and held-out prompts, as the run sets it up
        evaluation = instantiate(node)
        rows = datasets.Dataset.from_list([{"prompt": "abc"}, {"prompt": "xy"}])
        evaluation.setup(_tiny_policy().model, _tiny_policy().tokenizer, SimpleNamespace(frozen={}), rows)
        assert set(evaluation.produced(OmegaConf.to_container(node))) >= (
            {"eval/gen/kl", "eval/gen/reward"} if node._target_.endswith(".GenerationEval") else set())
    elif group == "peft":  # applied to a small policy: what trains is what it predicts
        adapter = instantiate(node)
        model = _small_model()
        predicted = adapter.trainable_parameters(model)
        model = adapter.apply(model)
        assert predicted == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
    else:  # a plain key (seed, ...) is covered by check_config; a group needs its builder here
        assert group not in GROUPS, f"no builder for {group}: add one to _build"


@pytest.mark.parametrize(("group", "option"), COMPONENTS, ids=[f"{g}={o}" for g, o in COMPONENTS])
def test_option_composes_checks_and_builds(group, option, tmp_path):
    extra = []
    if group == "algo/reference" and option == "model":  # a reference saved like a run's final/
        policy = _tiny_policy()
        policy.model.save_pretrained(tmp_path / "ref")
        policy.tokenizer.save_pretrained(tmp_path / "ref")
        extra = [f"algo.reference.name_or_path={tmp_path / 'ref'}"]
    if group == "algo/reference" and option in ("adapter", "ref_adapter"):  # on a LoRA policy
        extra = ["peft=lora"]
    if group == "algo/reference" and option == "ref_adapter":  # an adapter saved like a run's final/
        from rlhf.models.adapters import LoRA

        LoRA(r=2).apply(_tiny_policy().model).save_pretrained(tmp_path / "adapter")
        extra.append(f"algo.reference.path={tmp_path / 'adapter'}")
    if group == "algo/reward_funcs" and option == "reward_model":  # a reward model saved like a run's final/
        from rlhf.embedded.tiny_model import TinySpec

        policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                          warm_start_steps=0).build("sequence_classification")
        policy.model.save_pretrained(tmp_path / "rm")
        policy.tokenizer.save_pretrained(tmp_path / "rm")
        extra = [f"algo.reward_funcs.reward_model.path={tmp_path / 'rm'}"]
    if group == "algo/reward_funcs" and option == "sum_answer":  # the sums task's reward: on its data
        extra = ["data=sums"]
    if group in ONLINE_GROUPS:  # options of the online algorithms' own groups: composed into the one that has them
        extra.insert(0, "algo=ppo" if group == "algo/kl_controller" else "algo=grpo")
    cfg = compose_config(f"{group}={option}", *extra, output_dir=tmp_path)
    check_config(cfg)
    check_fields(OmegaConf.to_container(cfg.train), TrainSettings, "train")
    _build(group, cfg, tmp_path)


ONLINE_GROUPS = {"algo/scale_rewards", "algo/loss_type", "algo/importance_sampling_level", "algo/kl_estimator",
                 "algo/reward_funcs", "algo/kl_controller"}


def _check_hub_model(node: DictConfig) -> None:
    """What a Hub model preset gives load_policy, checked offline: the call, the id, the dtype, the template."""
    call = instantiate(node, _partial_=True)
    assert call.func is load_policy and not call.args
    name = node.name_or_path
    assert name.count("/") == 1 and all(name.split("/")) and node.dtype in (*DTYPES, "auto"), (name, node.dtype)
    if node.chat_template is not None:  # renders a conversation, as conversational data will be
        tokenizer = _tok()
        tokenizer.chat_template = node.chat_template
        messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert 0 <= text.index("hello there") < text.index("general kenobi"), text


@pytest.mark.parametrize("option", HUB_MODELS)
def test_model_hub_presets_are_checked_not_downloaded(option, tmp_path, monkeypatch):
    cfg = compose_config(f"model={option}", output_dir=tmp_path)
    check_config(cfg)
    _check_hub_model(cfg.model)
    # Offline (HF_HUB_OFFLINE=1, from conftest) and not cached: the loader takes it as a Hub id and stops at once.
    monkeypatch.setattr(hub, "in_cache", lambda *args, **kwargs: False)
    with pytest.raises(UserError, match=f"model.name_or_path={cfg.model.name_or_path}: not in the local Hugging Face"):
        build(cfg.model)


def _check_hub_data(node: DictConfig) -> None:
    """A Hub data preset builds its DataSource (nothing is read) with the preset's fields."""
    source = build(node)
    assert type(source) is DataSource and source.task is None
    fields = OmegaConf.to_container(node, resolve=True)
    del fields["_target_"]
    assert {key: getattr(source, key) for key in fields} == fields
    assert source.path.count("/") == 1 and all(source.path.split("/")), source.path
    assert source.eval_split and source.eval_split != source.split  # Hub presets hold out the dataset's own split


@pytest.mark.parametrize("option", HUB_DATA)
def test_data_hub_presets_build_their_source_without_download(option, tmp_path):
    cfg = compose_config(f"data={option}", output_dir=tmp_path)
    check_config(cfg)
    _check_hub_data(cfg.data)


SUBMITIT_BASE = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.BaseSubmititLauncher"


@pytest.mark.parametrize("option", LAUNCHERS)
def test_launcher_builds_its_hydra_launcher_which_takes_every_field(option, tmp_path, monkeypatch):
    assert option in LAUNCHER_CLASSES, f"add the hydra Launcher that conf/launcher/{option}.yaml builds"
    check_config(compose_config(f"launcher={option}", "hardware=cpu", output_dir=tmp_path))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        full = compose("config", return_hydra_config=True, overrides=[
            f"launcher={option}", "hardware=cpu", f"hydra.sweep.dir={tmp_path}", "output_dir=unused"])
        context = HydraContext(config_loader=GlobalHydra.instance().hydra.config_loader, callbacks=Callbacks())
        launcher = Plugins.instance().instantiate_launcher(hydra_context=context, task_function=print, config=full)
    kind = f"{type(launcher).__module__}.{type(launcher).__qualname__}"
    assert isinstance(launcher, Launcher) and kind == LAUNCHER_CLASSES[option]
    own = OmegaConf.load(CONF / "launcher" / f"{option}.yaml").get("hydra", {}).get("launcher", {})
    # By name: Hydra's plugin scan re-executes the modules under hydra_plugins (every time its registry is rebuilt,
    # e.g. after another test restored Hydra's singletons), so a class imported here may be an older copy.
    submitit_based = any(f"{c.__module__}.{c.__qualname__}" == SUBMITIT_BASE for c in type(launcher).__mro__)
    if not submitit_based:
        assert not own, f"{type(launcher).__name__} takes no fields"
        return
    for key in set(own) - {"_target_"}:  # every field the option sets reaches the launcher; a literal one as written
        assert key in launcher.params, key
        if not OmegaConf.is_interpolation(own, key):
            assert launcher.params[key] == OmegaConf.to_container(own)[key], key

    # Up to submission: submitit checks every field (an unknown one raises); map_array would submit the jobs.
    submitted = []

    def submit(executor, function, *arguments):
        submitted.append(executor)
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", submit)
    slurm = kind.endswith(".SlurmLauncher")
    if slurm:  # submitit looks for srun; none runs
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / "bin" / "srun").chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    assert launcher.launch([["seed=1"]], initial_job_idx=0) == [] and len(submitted) == 1
    executor, params = submitted[0]._executor, launcher.params
    if slurm:
        sbatch = executor._make_submission_file_text("python", "0")
        for line in (f"--time={params['timeout_min']}", f"--signal=USR2@{params['signal_delay_s']}",
                     f"--nodes={params['nodes']}", f"--ntasks-per-node={params['tasks_per_node']}"):
            assert f"#SBATCH {line}\n" in sbatch, (line, sbatch)
        assert executor.max_num_timeout == params["max_num_timeout"]
    else:
        assert executor.parameters["timeout_min"] == params["timeout_min"]
        assert executor.parameters["gpus_per_node"] == params["gpus_per_node"]


def _selection_points(sweeper: dict, objective) -> list[dict[str, str]]:
    """Every search job of a select-then-confirm sweep, and the confirm jobs of its first searched point; with
    ``confirm: every``, every confirm job of the first confirm seed (the others differ by their seed alone)."""
    from rlhf.sweeps.search import Study, as_overrides, grid

    study = Study.plan(sweeper["compare"], sweeper["search"], objective, confirm=sweeper.get("confirm", "chosen"))
    if study.every:
        confirmed = study.plan_confirm(as_overrides(sweeper["confirm_on"]))
        assert len(confirmed) == len(study.search) * len(grid(as_overrides(sweeper["confirm_on"])))
        first_seed = confirmed[0].overrides[-1]
        return [{o.partition("=")[0]: o for o in [*p.compared, *p.overrides]} for p in confirmed
                if p.overrides[-1] == first_seed]
    searched = [[*p.compared, *p.overrides, *as_overrides(sweeper["select_on"])] for p in study.search]
    study.search[0].value = 0.0
    confirmed = [[*p.compared, *p.overrides] for p in study.plan_confirm(as_overrides(sweeper["confirm_on"]))]
    assert len(confirmed) == len(grid(as_overrides(sweeper["confirm_on"])))
    return [{o.partition("=")[0]: o for o in job} for job in [*searched, *confirmed]]


def _sweep_points(params: dict) -> list[dict[str, str]]:
    """Every job of a sweep over `params` (hydra.sweeper.params) as {key: override}, as Hydra's basic sweeper makes
    them: each comma-separated (or range/choice) value of each key, all combinations; a search's interval (Optuna's
    sweeper) by its two ends."""
    choices = []
    for override in OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()]):
        key = override.get_key_element()
        if isinstance(override.value(), IntervalSweep):
            values = [override.value().start, override.value().end]
        elif override.is_sweep_override():
            values = override.sweep_string_iterator()
        else:
            values = [override.get_value_element_as_str()]
        choices.append([(override.key_or_group, f"{key}={value}") for value in values])
    return [dict(point) for point in itertools.product(*choices)]


@pytest.mark.parametrize("option", EXPERIMENTS)
def test_experiment_checks_and_builds_every_sweep_point_and_trains_the_first(option, tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        full = compose("config", overrides=[f"experiment={option}", "output_dir=unused"], return_hydra_config=True)
    built = None  # the groups of a point that are built (None: every key's)
    if full.hydra.mode == RunMode.MULTIRUN and "compare" in full.hydra.sweeper:  # select_then_confirm
        points = _selection_points(OmegaConf.to_container(full.hydra.sweeper), full.objective)
        assert len(points) > 1, f"experiment={option} is a multirun of one job"
    elif full.hydra.mode == RunMode.MULTIRUN and "workloads" in full.hydra.sweeper:  # optimizer_bench
        bench = Bench.from_config(OmegaConf.to_container(full.hydra.sweeper, resolve=True))
        jobs = [*bench.search_jobs(), *bench.confirm_jobs([])]  # each optimizer on the first workload, each
        first, reference = bench.workloads[0].name, next(iter(bench.spaces))  # workload with the first optimizer
        chosen = {(j.workload, j.optimizer): j for j in reversed(jobs) if j.workload == first or j.optimizer == reference}
        points = [{o.partition("=")[0]: o for o in job.overrides} for job in reversed(chosen.values())]
        built = {"algo", "optimizer"}
        assert len(points) == len(bench.workloads) + len(bench.spaces) - 1
    elif full.hydra.mode == RunMode.MULTIRUN:
        points = _sweep_points(OmegaConf.to_container(full.hydra.sweeper.params))
        assert len(points) > 1, f"experiment={option} is a multirun of one job"
    else:
        points = [{}]
    for i, point in enumerate(points):
        fast = [o for o in FAST if "model" not in point or not o.startswith("model.tiny.")]  # a workload of its own model
        cfg = compose_config(*fast, f"experiment={option}", *point.values(), output_dir=tmp_path / f"point{i}")
        check_config(cfg)
        for group in dict.fromkeys(key.split(".")[0].split("/")[0] for key in point):  # the swept components:
            if built is None or group in built:  # optimizer=... builds the optimizer, algo.beta=... the algorithm
                _build(group, cfg, tmp_path / f"point{i}")
    run = compose_config(*FAST, f"experiment={option}", *points[0].values(), "train.max_steps=2",
                         output_dir=tmp_path / "run")
    metrics = train(run)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_wrongly_typed_and_unknown_fields_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match=r"algo.beta='abc'.*float.*Fix: e.g. algo.beta=0.1"):
        check_config(compose_config("algo.beta=abc", output_dir=tmp_path))
    with pytest.raises(UserError, match=r"optimizer.lr='fast'"):
        check_config(compose_config("optimizer=lion", "optimizer.lr=fast", output_dir=tmp_path))
    with pytest.raises(UserError, match=r"has no argument 'betaa'"):
        check_config(compose_config("+algo.betaa=0.1", output_dir=tmp_path))
    with pytest.raises(UserError, match=r"train.max_steps='ten'"):
        check_fields({"max_steps": "ten"}, TrainSettings, "train")


def test_a_judge_given_as_a_name_and_an_unknown_compile_backend_are_refused_before_anything_loads(tmp_path):
    """Both passed the check and ended in a traceback once built (red: ``'str' object is not callable``, dynamo's
    ``InvalidBackend``); a judge given as a function node and a backend torch has pass."""
    with pytest.raises(UserError, match=r"eval.judge='my_judges.pairwise': GenerationEval takes a function for "
                                        r"'judge', not a str. Fix: 'eval.judge=\{_target_:my_judges.pairwise,_partial_:true\}'"):
        check_config(compose_config("eval=generate", "eval.judge=my_judges.pairwise", output_dir=tmp_path))
    check_config(compose_config("eval=generate", "eval.judge={_target_:builtins.max,_partial_:true}",
                                output_dir=tmp_path))
    with pytest.raises(UserError, match=r"hardware.compile=inductr: torch.compile has no backend 'inductr' .*"
                                        r"Fix: hardware.compile=inductor"):
        check_config(compose_config("hardware.compile=inductr", output_dir=tmp_path))
    check_config(compose_config("hardware.compile=aot_eager", output_dir=tmp_path))


class _Mixin:
    def __init__(self, call: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)


class _Base:
    def __init__(self, beta: float = 0.1, max_length: int | None = 1024) -> None:
        pass


class _Mixed(_Mixin, _Base):
    pass


def test_fields_passed_on_through_kwargs_are_those_of_the_next_init_in_the_mro():
    """A mixin's ``**kwargs`` reach the next ``__init__`` of the class's MRO (here ``_Base``), not the mixin's own
    base (``object``): those fields are accepted and typed, a misspelled one is still refused."""
    check_fields({"call": 2, "beta": 0.2, "max_length": None}, _Mixed, "algo")
    with pytest.raises(UserError, match=r"algo.betaa: .*_Mixed has no argument 'betaa'. Fix: algo.beta \(the field it resembles\). Valid fields: call, beta"):
        check_fields({"betaa": 0.2}, _Mixed, "algo")
    with pytest.raises(UserError, match=r"algo.beta='x'"):
        check_fields({"beta": "x"}, _Mixed, "algo")


def test_the_embedded_tasks_reward_is_refused_on_data_of_ones_own(tmp_path):
    """On a file of one's own, an online algorithm's default reward and eval=generate's (the prompt reversed: the
    embedded task's) are refused before anything loads; the embedded task keeps them, a reward of one's own passes."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{i}+{i}="}}\n' for i in range(4)))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(f'{{"prompt": "q{i}", "chosen": "a", "rejected": "b"}}\n' for i in range(4)))
    refused = {
        ("algo=grpo", f"data.path={prompts}"): r"^algo.reward_funcs: the algorithm trains on exact_match, the embedded "
                                               r"task's reward .* Fix: .*algo/reward_funcs=<your option>",
        ("algo=dpo", "eval=generate", f"data.path={pairs}"): r"^eval.reward_funcs: eval=generate scores its samples "
                                                             r"with similarity, the embedded .*algo/reward_funcs@eval=",
        # the algorithm's default when its node is removed: the embedded exact match, passed on through **kwargs
        ("algo=grpo", f"data.path={prompts}", "~algo.reward_funcs"): r"^algo.reward_funcs: the algorithm trains on "
                                                                     r"exact_match",
    }
    for overrides, message in refused.items():
        with pytest.raises(UserError, match=message):
            check_config(compose_config(*overrides, output_dir=tmp_path))
    check_config(compose_config("algo=grpo", output_dir=tmp_path))  # the embedded task: its own reward
    reverse = tmp_path / "reverse.jsonl"  # the embedded task's prompts written to a file (the benchmarks do)
    reverse.write_text("".join(f'{{"prompt": "{w}="}}\n' for w in ("abc", "hello", "xy")))
    check_config(compose_config("algo=grpo", f"data.path={reverse}", "algo/reward_funcs=similarity",
                                output_dir=tmp_path))
    check_config(compose_config("algo=dpo", "eval=generate", output_dir=tmp_path))
    mine = "+algo.reward_funcs.mine._target_=builtins.len"  # a function of one's own (any dotted name) is no task's
    check_config(compose_config("algo=grpo", f"data.path={prompts}", "~algo.reward_funcs.exact_match", mine,
                                "algo.reward_weights=null", output_dir=tmp_path))


def test_a_misspelt_field_is_answered_with_the_field_it_resembles():
    """Red when the message lists the valid fields without naming the one meant (heavyball's SOAP: a dozen)."""
    from rlhf.config.checks import check_fields
    from rlhf.optim.preconditioned import SOAP

    with pytest.raises(UserError, match=r"optimizer.shampo_beta: .*no argument 'shampo_beta'\. Fix: optimizer."
                                        r"shampoo_beta \(the field it resembles\)\. Valid fields: "):
        check_fields({"shampo_beta": 0.9}, SOAP, "optimizer")

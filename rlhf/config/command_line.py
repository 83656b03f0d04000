"""The command line's overrides, checked before Hydra composes the config: a mistyped group or key, and an option
a group does not have, get the project's message ("Did you mean optimizer=lion?") instead of Hydra's ("To append
to your config use +optimiser=lion", which leads the user to add a ``+`` and train with the defaults).

``train.py`` calls :func:`check_overrides` with ``sys.argv``; everything else is left to Hydra and to
:func:`rlhf.config.checks.check_config` once the config is composed (``+key=value``, ``~key``, ``hydra.*``, sweeps
written with functions such as ``choice(...)``).

It also names the fix when a command line selects a sweeper that comes from an optional extra which is not installed
(``hydra/sweeper=search``, directly or through an ``experiment=`` preset): Hydra would only say that it cannot find
the option.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from rlhf.config import trl_names
from rlhf.core import limits as validate

# Options that choose another primary config: the names in conf/config.yaml no longer say what is known.
_OTHER_PRIMARY = ("--config-dir", "--config-path", "--config-name", "-cd", "-cp", "-cn")


def group_options(group: str, folder: Path | None = None) -> list[str]:
    """The options of a config group: the YAML files of ``conf/<group>/`` (``a/b`` for ``conf/<group>/a/b.yaml``)."""
    folder = folder or validate.conf_dir()
    root = folder / group if folder is not None else None
    if root is None or not root.is_dir():
        return []
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def problem(argv: Sequence[str], folder: Path | None = None) -> str | None:
    """The message for the first override in `argv` that names no known group or key, or an option its group
    lacks, or a key of TRL's (:mod:`rlhf.config.trl_names`); None when there is none."""
    if any(arg.split("=")[0] in _OTHER_PRIMARY for arg in argv):
        return None
    known = validate.known_top_level(folder)
    if not known:
        return None
    folder = folder or validate.conf_dir()
    flag = _flag_problem(argv, folder)
    if flag:
        return flag
    for arg in argv:
        if arg.startswith("+") and "=" in arg:  # an addition: a TRL name added is still TRL's name
            found = _algo_key_problem(arg, argv, folder, added=True)
            if found:
                return found
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue  # a flag, a value of a flag, or an addition/removal (checked once composed)
        key, value = arg.split("=", 1)
        top = re.split(r"[./@]", key, maxsplit=1)[0]
        if top == "hydra":
            continue
        if top in ("search", "sweeper", "params", "select_on", "confirm_on") and top not in known:  # a sweeper's
            target = f"hydra.{key}" if top == "sweeper" else f"hydra.sweeper.{key}"  # settings: under hydra.sweeper
            return (f"{arg}: a sweep's grids and settings live under hydra.sweeper. Fix: \"{target}='{value}'\" "
                    "(quoted: a grid is one string; docs/how-to/compare-optimizers.md)")
        if top not in known:
            trl = trl_names.trl_fix(top) if top == key else None
            if trl:
                return f"{arg}: {trl}."
            return (f"{top} is not a config group or key ({arg}). "
                    + validate.unknown_name_hint(top, arg, known, "check the name (python train.py --help lists them)"))
        if top == "train" and key.count(".") == 1 and key.split(".")[1] not in _train_keys(folder):
            field = key.split(".")[1]
            trl = trl_names.trl_fix(field)
            close = difflib.get_close_matches(field, _train_keys(folder), n=1)
            # a length in epochs replaces the default length in steps: both are set, or neither would be
            other = " train.max_steps=null" if close and close[0] == "num_epochs" and not any(
                a.startswith("train.max_steps=") for a in argv) else ""
            hint = f"{trl}." if trl else f"Did you mean train.{close[0]}={value}{other}?" if close else \
                f"Fix: one of train.{{{', '.join(_train_keys(folder))}}}."
            return f"{arg}: train has no key {field!r}. {hint}"
        if top == "algo" and key != "algo":
            found = _algo_key_problem(arg, argv, folder, added=False)
            if found:
                return found
        if known[top] == "group" and key == top:
            found = _option_problem(top, value, folder, argv)
            if found:
                return found
        elif known[top] == "group" and "." in key:
            found = _nested_option_problem(top, key, value, folder)
            if found:
                return found
    return None


# Hydra's own command-line flags (python train.py --help); anything else written --name is another tool's style.
_HYDRA_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p", "--run",
                "-r", "--multirun", "-m", "--shell-completion", "-sc", "--info", "-i", "--experimental-rerun",
                *_OTHER_PRIMARY)


def _flag_problem(argv: Sequence[str], folder: Path) -> str | None:
    """``--learning_rate 5e-6`` (argparse's style, TRL's scripts'): the override it means, ``key=value``, itself
    checked (``--lr 5e-6``: ``lr`` is no key either)."""
    for index, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if not name.startswith("--") or name in _HYDRA_FLAGS or name == "--":
            continue
        key, written = name[2:], arg
        following = argv[index + 1] if index + 1 < len(argv) else ""
        if not equals and following and not following.startswith("-") and "=" not in following:
            value, written = following, f"{arg} {following}"
        value = value or "<value>"
        trl = trl_names.TRL_NAMES.get(key)
        fix = f"{trl.replace('<value>', value)} ({key} is TRL's name)" if trl else f"{key}={value}"
        undashed = None if trl else problem([f"{key}={value}"], folder)
        if undashed:  # no key of ours either: what that override would get
            fix = f"{key}={value}, but {undashed}"
        return f"{written}: overrides are written key=value, without dashes (Hydra's command line). Fix: {fix}"
    return None


def _train_keys(folder: Path) -> list[str]:
    """The keys of ``train`` in ``conf/config.yaml``."""
    import yaml

    loaded = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    return sorted((loaded.get("train") or {}).keys())


def _chosen_algo(argv: Sequence[str], folder: Path) -> str | None:
    """The ``algo`` option the command line runs (the last ``algo=``, an ``experiment=``'s, else the default);
    None for several (a sweep) or one this check cannot tell."""
    chosen = None
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "algo":
            chosen = value
        elif key == "experiment" and chosen is None:
            if not (folder / "experiment" / f"{value}.yaml").is_file():  # a sweep over presets, or another path's
                return None
            for entry in _defaults(folder / "experiment" / f"{value}.yaml"):
                for name, option in (entry.items() if isinstance(entry, dict) else ()):
                    if str(name).split()[-1].strip("/") == "algo":
                        chosen = str(option)
    if chosen is None:
        for entry in _defaults(folder / "config.yaml"):
            if isinstance(entry, dict) and "algo" in entry:
                chosen = str(entry["algo"])
    if chosen is None or not (folder / "algo" / f"{chosen}.yaml").is_file():
        return None
    return chosen


def _algo_fields(option: str, folder: Path) -> tuple[set[str], set[str]]:
    """``(keys, groups)`` of ``conf/algo/<option>.yaml`` with the options it extends (``defaults: [dpo]``): its
    fields (with those its selected group options put at ``algo`` itself, ``# @package algo``: ``reward_weights``),
    and the groups below ``algo`` it selects (``loss``, ``reference``, ``loss_type``...)."""
    import yaml

    keys: set[str] = set()
    groups: set[str] = set()
    try:
        loaded = yaml.safe_load((folder / "algo" / f"{option}.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return keys, groups
    for entry in loaded.get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_" and (folder / "algo" / f"{entry}.yaml").is_file():
            base_keys, base_groups = _algo_fields(entry, folder)
            keys |= base_keys
            groups |= base_groups
        elif isinstance(entry, dict):
            for name, choice in entry.items():
                group = str(name).split()[-1].strip("/")
                groups.add(group)
                selected = folder / "algo" / group / f"{choice}.yaml"
                if selected.is_file() and "# @package algo\n" in selected.read_text():
                    keys |= {str(k) for k in (yaml.safe_load(selected.read_text()) or {}) if k != "defaults"}
    keys |= {str(k) for k in loaded if k != "defaults"}
    return keys, groups


def _algo_key_problem(arg: str, argv: Sequence[str], folder: Path, added: bool) -> str | None:
    """``algo.<field>=``, ``algo/<group>=`` (or ``+algo.<field>=``, ``added``) that the chosen algorithm does not
    have: TRL's ``loss_type`` told apart (:func:`rlhf.config.trl_names.loss_type_fix`), a group typed with a dot, the
    other TRL names, or the algorithm's own fields."""
    key, value = arg.lstrip("+").split("=", 1)
    if not key.startswith(("algo.", "algo/")):
        return None
    if "@" in key and (folder / key.split("@")[0]).is_dir():  # a group's option placed under another key
        return _option_problem(key.split("@")[0], value, folder, argv, key)  # (algo/reward_funcs@eval=...)
    option = _chosen_algo(argv, folder)
    if option is None:
        return None
    keys, groups = _algo_fields(option, folder)
    field = re.split(r"[./]", key)[1]
    if key == f"algo.{field}" and field in groups and value.lstrip().startswith("{") and not added:
        return (f"{arg}: algo.{field} is filled by its config group's options (algo/{field}=<option>, "
                f"conf/algo/{field}/), so a whole new value cannot replace it from the command line. Fix: add one "
                f"entry, '+algo.{field}.<name>=<value>', or put the entries in a YAML option of your own config folder: "
                f"hydra.searchpath=[file://conf] algo/{field}=mine (docs/how-to/your-reward.md)")
    if re.search(r"[${}()\[\]*,]", value):
        return None
    if key.startswith("algo/") and (field in groups or added):  # a group it selects, or one a search path adds
        return None
    if key.startswith("algo.") and field in groups:
        if "." not in key[5:] and not added and field not in keys:  # the group's node itself, typed with a dot
            return f"{arg}: algo/{field} is a config group. Fix: algo/{field}={value} (a slash, not a dot)"
        return None  # a key below a group's node (algo.loss.gamma, +algo.reward_funcs.mine._target_)
    if key.startswith("algo.") and field in keys and not (field == "loss_type" and added):
        return None
    if field == "loss_type":
        fix = trl_names.loss_type_fix(value, [o for o in group_options("algo", folder) if "/" not in o],
                                      group_options("algo/loss", folder), group_options("algo/loss_type", folder),
                                      online="loss_type" in groups)
        return f"{arg}: algo={option} has no {'group algo/' if key.startswith('algo/') else 'key '}loss_type. {fix}"
    if key.startswith("algo/"):
        others = [g for g in groups if value in group_options(f"algo/{g}", folder)]
        hint = f"Did you mean algo/{others[0]}={value}?" if others else \
            f"algo={option}'s groups: {', '.join(f'algo/{g}' for g in sorted(groups))}."
        where = "belongs to other algorithms" if (folder / "algo" / field).is_dir() else "is no group"
        return f"{arg}: algo/{field} {where}; algo={option} does not select it. {hint}"
    if added and field in keys:
        return None
    trl = trl_names.trl_fix(field)
    if trl and not trl_names.TRL_NAMES[field].startswith("algo."):
        return f"{arg}: {trl}."
    having = [o for o in group_options("algo", folder) if "/" not in o and field in _algo_fields(o, folder)[0]]
    if added and not having and not trl:
        return None  # a key no algorithm has: check_config names the fields of the target
    close = difflib.get_close_matches(field, sorted(keys), n=1)
    more = f" and {len(having) - 6} more" if len(having) > 6 else ""
    hint = (f"{field} is an option of algo={', '.join(having[:6])}{more}." if having
            else f"Did you mean algo.{close[0]}={value}?" if close else "")
    return (f"{arg}: algo={option} has no option {field!r} (its options: {', '.join(sorted(keys - {'_target_'}))}). "
            f"{hint}").rstrip()


def _nested_option_problem(group: str, key: str, value: str, folder: Path | None) -> str | None:
    """``logger.mode=offline`` where the group's options sit under their own names (``# @package logger.wandb``,
    so that several can be chosen at once): name the key with the option in it."""
    folder = folder or validate.conf_dir()
    options = group_options(group, folder)
    nested = [o for o in options if f"# @package {group}.{o}\n" in (folder / group / f"{o}.yaml").read_text()]
    field = key.split(".")[1]
    if not options or len(nested) < len(options) or field in options:
        return None
    having = [o for o in options if re.search(rf"^{re.escape(field)}:", (folder / group / f"{o}.yaml").read_text(), re.M)]
    example = f"{group}.{having[0]}.{key.split('.', 1)[1]}={value}" if having else f"{group}.<option>.{field}=..."
    return (f"{key}: each {group} option sits under its own key ({group}.<option>.<field>), so that several can be "
            f"chosen at once ({group}=[a,b]). Fix: {example}.")


def search_folders(argv: Sequence[str]) -> list[Path] | None:
    """The config folders a command adds with ``hydra.searchpath=[file://<folder>, ...]`` (relative to the current
    folder, as Hydra reads them); None where an entry is no folder this check can read (``pkg://``, an
    interpolation, a folder not there): what that entry holds is then left to Hydra."""
    folders = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") != "hydra.searchpath":
            continue
        for item in value.strip().strip("[]").split(","):
            item = item.strip().strip("'\"")
            if not item:
                continue
            if not item.startswith("file://") or not Path(item[len("file://"):]).is_dir():
                return None
            folders.append(Path(item[len("file://"):]))
    return folders


def _option_problem(group: str, value: str, folder: Path | None, argv: Sequence[str] = (),
                    typed: str | None = None) -> str | None:
    """``group=value`` naming an option that neither ``conf/<group>/`` nor a folder of the command's
    ``hydra.searchpath`` has; the message names the override as typed (``typed``: e.g. ``algo/reward_funcs@eval``)."""
    extra = search_folders(argv)
    if extra is None:
        return None  # a search path this check cannot read: Hydra says what it lacks
    extra = [f for f in extra if (f / group).is_dir()]
    options = sorted({*group_options(group, folder), *(o for f in extra for o in group_options(group, f))})
    if not options or re.search(r"[${}()\[\]*]", value):
        return None  # no such folder here (another search path), or an interpolation or sweep function
    typed = typed or group
    for option in value.split(","):
        option = option.strip()
        if option in options or option in ("null", ""):
            continue
        # the group's own options: a sub-folder's files are the options of another group (algo/loss=...)
        own = [o for o in options if "/" not in o] or options
        close = difflib.get_close_matches(option, own, n=1)
        hint = f"Did you mean {typed}={close[0]}?" if close else f"Fix: {typed}=<one of them>."
        where = f"conf/{group}/" + "".join(f" nor {f / group}/" for f in extra)
        return f"{typed}={option}: {where} has no option {option!r} (options: {', '.join(own)}). {hint}"
    return None


# Hydra sweepers that an optional extra of the package installs: {option: (the module Hydra finds it in, the extra)}.
# An option of conf/hydra/sweeper/ that extends one of them (``defaults: [optuna, ...]``) needs the same extra.
EXTRA_SWEEPERS = {"optuna": ("hydra_plugins.hydra_optuna_sweeper", "search")}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing too
        return False


def _defaults(path: Path) -> list:
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return []  # Hydra reports a broken file
    return loaded.get("defaults") or [] if isinstance(loaded, dict) else []


def _sweepers(argv: Sequence[str], folder: Path) -> list[tuple[str, str]]:
    """The sweeper options the command line selects: [(option, where it was selected)]. ``hydra/sweeper=`` on the
    command line wins over an ``experiment=`` preset's ``override /hydra/sweeper: <option>``."""
    chosen: list[tuple[str, str]] = []
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "hydra/sweeper":
            chosen = [(value, f"hydra/sweeper={value}")]
    if chosen:
        return chosen
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key != "experiment":
            continue
        for name in filter(None, (v.strip() for v in value.split(","))):
            for entry in _defaults(folder / "experiment" / f"{name}.yaml"):
                for entry_key, option in (entry.items() if isinstance(entry, dict) else ()):
                    if str(entry_key).split()[-1].strip("/") == "hydra/sweeper":
                        chosen.append((str(option), f"experiment={name} (hydra/sweeper={option})"))
    return chosen


def missing_extra(argv: Sequence[str], folder: Path | None = None) -> str | None:
    """The message for a sweeper the command line selects whose optional extra is not installed; None if none."""
    folder = folder or validate.conf_dir()
    if folder is None:
        return None
    for option, where in _sweepers(argv, folder):
        bases = [option, *(e for e in _defaults(folder / "hydra" / "sweeper" / f"{option}.yaml") if isinstance(e, str))]
        for base in bases:
            if base in EXTRA_SWEEPERS and not _installed(EXTRA_SWEEPERS[base][0]):
                extra = EXTRA_SWEEPERS[base][1]
                return (f"{where} needs Hydra's {base} sweeper, which comes with the optional extra [{extra}], not "
                        f'installed here. Fix: pip install -e ".[{extra}]" (scripts/setup.sh installs it)')
    return None


def check_overrides(argv: Sequence[str]) -> None:
    """Print the message for a bad override in `argv` (``sys.argv[1:]``) and exit 1, before Hydra composes."""
    message = problem(argv) or missing_extra(argv)
    if message:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(1)

"""The configuration reference, generated from ``conf/``: every config group, every option (one YAML file) with its
opening comment, and every field with its default and the comment on its line, so the reference cannot drift from
the files the runs read. An option without an opening comment, or a field of a component without one, is an error:
the documentation build (``mkdocs build``, through ``docs/hooks.py``) fails on it.

    python scripts/config_reference.py                 # writes docs/reference/config.md
    python scripts/config_reference.py --check         # exit 1 and name each option or field without a comment
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
OUT = ROOT / "docs" / "reference" / "config.md"
# Options whose fields are a preset's overrides of other groups (a recipe, read whole) rather than a component's own
# arguments: their opening comment is required, a comment per line is not.
PRESET_GROUPS = ("experiment", "hydra/help")
KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w./@-]*|\"[^\"]+\"):(?P<rest>.*)$")


@dataclasses.dataclass
class Field:
    key: str  # dotted, from the file's root
    value: str
    comment: str


@dataclasses.dataclass
class Option:
    group: str  # "" for conf/config.yaml
    name: str
    path: Path
    about: str
    defaults: list[Field]
    fields: list[Field]
    text: str

    @property
    def preset(self) -> bool:
        return self.group.startswith(PRESET_GROUPS)


def split_comment(text: str) -> tuple[str, str]:
    """``value  # comment`` -> (value, comment); a ``#`` inside quotes or braces is part of the value."""
    quote, depth, escaped = None, 0, False
    for i, char in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif char == "\\" and quote == '"':
                escaped = True
            elif char == quote:
                quote = None
        elif char in "'\"" and text[:i].rstrip()[-1:] in ("", "[", "{", ",", ":"):  # a quoted scalar starts
            quote = char
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == "#" and depth == 0 and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip(), text[i + 1:].strip()
    return text.strip(), ""


def parse(path: Path, group: str) -> Option:
    lines = path.read_text().splitlines()
    about = []
    body_start = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    for line in lines[:body_start]:
        if not line.startswith("# @package"):
            about.append(line[1:].strip())
    defaults, fields, stack, in_defaults, block_indent, list_indent = [], [], [], False, None, None
    for line in lines[body_start:]:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if block_indent is not None:  # inside a block scalar (key: |)
            if indent > block_indent:
                continue
            block_indent = None
        if list_indent is not None:  # inside a list's items (read as the list's value, not as fields)
            if indent > list_indent or (indent == list_indent and line.lstrip().startswith("- ")):
                continue
            list_indent = None
        if line.lstrip().startswith("- "):
            if in_defaults:
                value, comment = split_comment(line.lstrip()[2:])
                defaults.append(Field("defaults", value, comment))
            else:
                list_indent = indent
            continue
        match = KEY.match(line)
        if not match:
            continue
        key, (value, comment) = match["key"].strip('"'), split_comment(match["rest"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([*(k for _, k in stack), key])
        in_defaults = dotted == "defaults"
        if in_defaults:
            continue
        if re.fullmatch(r"[|>][+-]?\d*[+-]?", value):
            block_indent, value = indent, "(text)"
        if value == "":
            stack.append((indent, key))
            if comment:
                fields.append(Field(dotted, "", comment))
            continue
        fields.append(Field(dotted, value, comment))
    name = path.stem
    return Option(group, name, path, " ".join(about), defaults, fields, "\n".join(lines[body_start:]).strip())


def options(conf: Path = CONF) -> list[Option]:
    """Every option under ``conf``, by group."""
    found = []
    for path in sorted(conf.rglob("*.yaml")):
        relative = path.relative_to(conf)
        group = str(relative.parent) if relative.parent != Path(".") else ""
        found.append(parse(path, group))
    return found


def problems(found: list[Option]) -> list[str]:
    """Each option without an opening comment, and each field of a component (not a preset) without a comment."""
    out = []
    for option in found:
        where = option.path.relative_to(ROOT) if option.path.is_relative_to(ROOT) else option.path
        if not option.about:
            out.append(f"{where}: no opening comment (say what the option is and how to choose it, in '# ...' lines "
                       "at the top)")
        if option.preset:
            continue
        for field in option.fields:
            if not field.comment and not field.key.startswith(("hydra.", "_")) and not field.key.endswith(
                    ("._target_", "._partial_")):
                out.append(f"{where}: field {field.key} has no comment (add '# what it is' on its line)")
    return out


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(found: list[Option]) -> str:
    groups: dict[str, list[Option]] = {}
    for option in found:
        groups.setdefault(option.group, []).append(option)
    lines = ["# Configuration reference", "",
             "Generated from `conf/` by `scripts/config_reference.py` (the documentation build runs it and fails on "
             "an option or field without a comment): every config group, each option with what its file says, and "
             "each field with its default. Choose an option with `group=option` on the command line "
             "(`python train.py algo=ipo`), set a field with `group.field=value` (`algo.beta=0.1`).", "",
             "Groups: " + ", ".join(f"[`{g or 'config.yaml'}`](#{anchor(g)})" for g in groups), ""]
    for group, members in groups.items():
        lines += [f"## {group or 'config.yaml (the root)'} {{#{anchor(group)}}}", ""]
        if group:
            lines += [f"Options: {', '.join(f'`{m.name}`' for m in members)}. Usage: `{group}=<option>`.", ""]
        for option in members:
            if group:
                lines += [f"### `{group}={option.name}`", ""]
            lines += [option.about or "(no description)", "",
                      f"File: `{option.path.relative_to(ROOT) if option.path.is_relative_to(ROOT) else option.path}`",
                      ""]
            if option.defaults:
                lines += ["Composed from:", ""] + [f"- `{d.value}`" + (f": {d.comment}" if d.comment else "")
                                                   for d in option.defaults] + [""]
            if option.preset:
                lines += ["```yaml", option.text, "```", ""]
                continue
            shown = [f for f in option.fields if f.value or f.comment]
            if shown:
                lines += ["| field | default | meaning |", "|---|---|---|"]
                lines += [f"| `{cell(f.key)}` | `{cell(f.value)}` | {cell(f.comment)} |" if f.value else
                          f"| `{cell(f.key)}` | | {cell(f.comment)} |" for f in shown]
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def anchor(group: str) -> str:
    return "group-" + (re.sub(r"[^a-z0-9]+", "-", group.lower()).strip("-") or "root")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that every option and field has a comment")
    parser.add_argument("--out", type=Path, default=OUT, help="the page to write")
    args = parser.parse_args()
    found = options()
    missing = problems(found)
    if missing:
        print("\n".join(missing), file=sys.stderr)
        print(f"{len(missing)} option(s) or field(s) without a comment in conf/", file=sys.stderr)
        return 1
    if not args.check:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown(found))
        print(f"written {args.out} ({len(found)} options)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

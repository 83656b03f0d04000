"""Bring any of TRL's dataset formats to plain text columns an algorithm can tokenize.

Accepted formats (https://huggingface.co/docs/trl/dataset_formats):

=====================  =========================================  ===========================================
kind                   standard (strings)                         conversational (lists of role/content)
=====================  =========================================  ===========================================
language modeling      ``text``                                   ``messages``
prompt-completion      ``prompt``, ``completion``                 ``prompt``, ``completion``
preference             ``prompt``, ``chosen``, ``rejected``       same, as message lists
implicit-prompt pref.  ``chosen``, ``rejected``                   same, as message lists
=====================  =========================================  ===========================================

Conversational rows are rendered with the tokenizer's chat template, as TRL 1.16 renders them: the prompt with the
generation prompt appended, and each answer as the whole conversation (prompt + answer messages), which the
algorithm tokenizes and splits where it diverges from the prompt (:mod:`rlhf.data.encoding`; no EOS appended: the
template closes the turn). Each row says which it is in :data:`~rlhf.data.encoding.FORMAT_COLUMN`: ``text``,
``chat``, or ``whole_chat`` for an SFT ``messages`` row, every token of which is trained (TRL's conversational
language modeling; its prompt column still holds the conversation before the last assistant turn, for generation).

Unpaired rows (KTO): ``prompt``, ``completion`` and a ``label`` (true: desirable, false: undesirable), TRL's
unpaired preference format; preference rows given to an algorithm that asks for them become two rows each, the
chosen answer desirable and the rejected one not (TRL's ``unpair_preference_dataset``). Typed columns
(:data:`rlhf.data.checks.TYPED`: ``label``, a reward model's ``margin``) pass through as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from datasets import Dataset
from jinja2 import TemplateError

from rlhf.core.errors import UserError
from rlhf.data.checks import ROW_COLUMN, TYPED
from rlhf.data.encoding import CHAT, FORMAT_COLUMN, TEXT, WHOLE_CHAT, common_prefix_length

Messages = list[dict[str, str]]
ANSWERS = ("completion", "chosen", "rejected")  # the columns rendered as the assistant's turn of a conversation


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _render(tokenizer, messages: Messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _extract_prompt(row: dict[str, Any]) -> dict[str, Any]:
    """Implicit-prompt preference rows: the shared beginning of chosen and rejected is the prompt."""
    chosen, rejected = row["chosen"], row["rejected"]
    n = common_prefix_length(chosen, rejected)
    if isinstance(chosen, str) and n > 0 and chosen[n - 1] != " " and " " in chosen[:n]:
        n = chosen[:n].rindex(" ") + 1  # cut at a word boundary, not inside a word
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def to_rows(row: dict[str, Any], columns: Sequence[str], tokenizer) -> list[dict[str, Any]]:
    """One row of any accepted format -> the rows with exactly `columns`: one row, or two unpaired rows (``label``
    true for the chosen answer, false for the rejected one) from a preference pair when `columns` ask for
    ``completion`` and ``label``. The typed columns among `columns` (``label``, ``margin``) keep their values."""
    if "label" in columns and "completion" in columns and "label" not in row and "chosen" in row:
        pair = to_text(row, ("prompt", "chosen", "rejected"), tokenizer)
        return [{"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen",
                 FORMAT_COLUMN: pair[FORMAT_COLUMN],
                 **{c: row[c] for c in columns if c in TYPED and c != "label" and c in row}}
                for side in ("chosen", "rejected")]
    return [to_text(row, columns, tokenizer)]


def to_text(row: dict[str, Any], columns: Sequence[str], tokenizer) -> dict[str, Any]:
    """One row of any accepted format -> a row with exactly `columns`, all strings but the typed ones
    (:data:`rlhf.data.checks.TYPED`), which keep their values, and :data:`~rlhf.data.encoding.FORMAT_COLUMN`."""
    typed = {column: row[column] for column in columns if column in TYPED}
    columns = [column for column in columns if column not in TYPED]
    return {**_to_text(row, columns, tokenizer), **typed}


def _to_text(row: dict[str, Any], columns: Sequence[str], tokenizer) -> dict[str, str]:
    if "chosen" in columns and "prompt" not in row:
        row = _extract_prompt(row)
    whole = False
    if "prompt" not in row and "messages" in row:  # the last assistant turn is the completion, the rest the prompt
        messages = row["messages"]
        answered = bool(messages) and messages[-1]["role"] == "assistant"
        if any(column in ANSWERS for column in columns):
            cut = len(messages) - 1 if answered else 0
            row, whole = {**row, "prompt": messages[:cut], "completion": messages[cut:]}, True
        else:  # prompt-only (online algorithms): the conversation up to its last answer, or all of it, is the prompt
            row = {**row, "prompt": messages[:-1] if answered else messages}
    elif "completion" in columns and "completion" not in row and "text" in row:
        row = {"prompt": "", "completion": row["text"]}
    prompt = row["prompt"]
    answers = [column for column in columns if column in ANSWERS]
    others = {column: row[column] for column in columns if column != "prompt" and column not in ANSWERS}  # as they
    # are: an online algorithm's reward columns (a reference answer), which no template renders
    if not answers:  # prompt-only format (online algorithms)
        if _is_conversation(prompt):
            return {"prompt": _render(tokenizer, prompt, True), **others, FORMAT_COLUMN: CHAT}
        return {"prompt": prompt, **others, FORMAT_COLUMN: TEXT}
    if not any(_is_conversation(row[c]) for c in ["prompt", *answers]):
        return {"prompt": prompt, **{column: row[column] for column in answers}, **others, FORMAT_COLUMN: TEXT}
    # One part is a conversation: all are (plain text becomes a user prompt or an assistant answer). The prompt is
    # rendered with the generation prompt, each answer as the whole conversation (rlhf.data.encoding splits them).
    prompt_messages = prompt if _is_conversation(prompt) else ([{"role": "user", "content": prompt}] if prompt else [])
    out = {"prompt": _render(tokenizer, prompt_messages, True) if prompt_messages else ""}
    for column in answers:
        value = row[column]
        value_messages = value if _is_conversation(value) else [{"role": "assistant", "content": value}]
        out[column] = _render(tokenizer, prompt_messages + value_messages, False)
    # An SFT `messages` row is TRL's conversational language modeling: every token of it is trained.
    return {**out, **others, FORMAT_COLUMN: WHOLE_CHAT if whole else CHAT}


# Which raw columns can stand in for the columns an algorithm asks for.
_ALTERNATIVES = {
    ("prompt", "completion"): [("prompt", "completion"), ("messages",), ("text",)],
    ("prompt", "chosen", "rejected"): [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
    ("prompt",): [("prompt",), ("messages",)],
    ("prompt", "completion", "label"): [("prompt", "completion", "label"), ("prompt", "chosen", "rejected"),
                                        ("chosen", "rejected")],
}


def pick_format(names: Sequence[str], columns: Sequence[str], where: str = "the dataset") -> tuple[str, ...]:
    """The raw columns (the first of :data:`_ALTERNATIVES` that `names` has) that provide `columns`."""
    columns = tuple(columns)
    options = _ALTERNATIVES.get(columns, [columns])
    for option in options:
        if set(option) <= set(names):
            return option
    wanted = " or ".join("/".join(option) for option in options)
    shown = [name for name in names if name != ROW_COLUMN]
    other = [fit for fit, algo in _OTHER_ALGORITHMS if set(fit) <= set(names) and not set(fit) <= set(columns)]
    if other:  # the data has the columns of another kind of training
        fix = f"Fix: {dict(_OTHER_ALGORITHMS)[other[0]]} for such data, or give it {wanted} columns."
    else:
        # The format the data comes closest to: the most of its columns present (at least one), the fewest missing.
        near = max(options, key=lambda option: (len(set(option) & set(names)), -len(option)))
        missing = [column for column in near if column not in names]
        if set(near) & set(names) and len(missing) < len(near):
            adds = ", ".join(f"a {column!r} column ({_MEANING.get(column, 'text')})" for column in missing)
            named = ",".join(f"{column}:<its name>" for column in missing)
            fix = (f"Fix: add {adds}; or, if the data has them under other names, name them: "
                   f"data.columns={{{named}}}.")
        else:
            fix = ("Fix: name the data's columns for the ones this algorithm takes (e.g. data.columns={prompt:"
                   "question,chosen:good,rejected:bad}) or pick an algorithm that fits the data (preference pairs -> "
                   "algo=dpo, demonstrations -> algo=sft).")
    raise UserError(f"{where} has columns {shown}, but this algorithm needs {wanted}. {fix}")


# What each column holds, for the message that asks for a missing one.
_MEANING = {"prompt": "the input of each row", "completion": "the answer to learn",
            "chosen": "the preferred answer of each pair", "rejected": "the worse answer of each pair",
            "label": "true where the completion is desirable, false where not"}
# Columns that mean another kind of training, and the option that trains on them.
_OTHER_ALGORITHMS = ((("chosen", "rejected"), "algo=dpo"), (("prompt", "completion", "label"), "algo=kto"),
                     (("prompt", "completion"), "algo=sft"),
                     (("messages",), "algo=sft"))


def _rows_to_text(batch: dict[str, list], columns: Sequence[str], tokenizer, where: str) -> dict[str, list]:
    """:func:`to_rows` over a batch of rows, keeping each row's origin (:data:`ROW_COLUMN`; an unpaired row's says
    which answer of the pair it is) and naming it if the chat template fails."""
    out: dict[str, list] = {column: [] for column in (*columns, FORMAT_COLUMN)}
    if ROW_COLUMN in batch:
        out[ROW_COLUMN] = []
    for values in zip(*batch.values()):
        row = dict(zip(batch, values))
        try:
            made = to_rows(row, columns, tokenizer)
        except TemplateError as error:
            raise UserError(f"{row.get(ROW_COLUMN) or where}: the tokenizer's chat template refused this "
                            f"conversation ({error}). Fix: change the conversation to what the template accepts (e.g. "
                            "alternating user/assistant turns), or set model.chat_template.") from error
        for new in made:
            if ROW_COLUMN in row:
                side = (", its chosen answer" if new["label"] else ", its rejected answer") if len(made) > 1 else ""
                new[ROW_COLUMN] = row[ROW_COLUMN] + side
            for key in out:
                out[key].append(new[key])
    return out


def standardize(dataset: Dataset, columns: Sequence[str], tokenizer, where: str = "the dataset",
                optional: Sequence[str] = ()) -> Dataset:
    """Check `dataset` has a format that provides `columns`, then convert every row to text columns (typed columns
    as they are; a preference pair to two unpaired rows where `columns` ask for them, see :func:`to_rows`).

    The `optional` columns the dataset has, and a :data:`~rlhf.data.checks.ROW_COLUMN` column (where each row came
    from), are kept.
    """
    pick_format(dataset.column_names, tuple(columns), where)
    columns = (*columns, *(c for c in optional if c in dataset.column_names and c not in columns))
    sample = dataset[0] if len(dataset) else {}
    conversational = any(_is_conversation(v) for v in sample.values())
    if conversational and getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            f"{where} is conversational but the tokenizer has no chat template. "
            "Fix: use an instruct model or set model.chat_template='<jinja template>'."
        )
    return dataset.map(
        _rows_to_text,
        batched=True,
        fn_kwargs={"columns": columns, "tokenizer": tokenizer, "where": where},
        remove_columns=dataset.column_names,
        desc="formatting",
    )

"""Prompt and answer text to token ids exactly as TRL 1.16 tokenizes them (its SFT, DPO, KTO and reward trainers).

TRL tokenizes the prompt alone and the whole sequence (prompt + answer) and starts the answer where the two token
lists diverge (``common_prefix_length``), so that the sequence trained on is the whole sequence as one tokenization
gives it, never a prompt and an answer tokenized apart and glued:

- **standard rows** (plain text): ``tokenizer(prompt)`` and ``tokenizer(prompt + answer + EOS)`` with the
  tokenizer's own special tokens (a Llama tokenizer's BOS; none for GPT-2, Qwen or the embedded byte tokenizer), the
  EOS text appended where the answer does not already end with it;
- **conversational rows**: the chat template renders the prompt with the generation prompt and the whole
  conversation (prompt + answer messages), tokenized without special tokens (the template writes its own). No EOS
  is appended: the template closes the assistant's turn itself (ChatML's ``<|im_end|>`` and newline), and a second
  end token after it is what no template produces. The rows reach here already rendered (:mod:`rlhf.data.formats`:
  the prompt column holds the rendered prompt, each answer column the whole rendered conversation, and
  :data:`FORMAT_COLUMN` says which of these a row is);
- **whole conversations** (an SFT ``messages`` row, TRL's conversational language modeling): every token is trained.

When the tokenized prompt is not a prefix of the tokenized whole (a template that renders the prompt alone
differently, or tokens that merge across the boundary), the answer starts where they diverge and the prompt's
end is left out of the training sequence; a warning says so once, as TRL's does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

FORMAT_COLUMN = "_format"  # kept next to the text columns: how a row's text columns are to be tokenized
TEXT = "text"  # standard rows: prompt and answers are plain text; EOS is appended to each answer
CHAT = "chat"  # the prompt rendered with the generation prompt, each answer column the whole rendered conversation
WHOLE_CHAT = "whole_chat"  # like CHAT, and every token of the conversation is trained (SFT's ``messages`` rows)
FORMATS = (TEXT, CHAT, WHOLE_CHAT)

TRUNCATED = "_truncated"  # a tokenized row's key: what truncation cut (bit flags below; 0: nothing)
PROMPT_CUT = 1  # the prompt was longer than max_prompt_length and kept its end
END_CUT = 2  # prompt + completion were longer than max_length and lost their end

_warned = False


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """How many leading tokens ``ids`` and ``other`` share."""
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def tokens(tokenizer, text: str, chat: bool = False) -> list[int]:
    """``text``'s token ids: a rendered chat template carries its own special tokens; plain text gets the
    tokenizer's (TRL's ``_tokenize``), except a BOS it already starts with (text a template rendered and handed on
    as plain text: a prompt a reward function or ``step()`` receives), which is not doubled. TRL would add a second
    one there; a plain row of a data file does not start with the BOS text."""
    bos = getattr(tokenizer, "bos_token", None)
    special = not chat and not (bos and text.startswith(bos))
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _with_eos(tokenizer, answer: str) -> str:
    eos = tokenizer.eos_token
    return answer if not eos or answer.endswith(eos) else answer + eos


def encode_answers(tokenizer, prompt: str, answers: Mapping[str, str], form: str = TEXT,
                   max_prompt_length: int | None = None, max_length: int | None = None
                   ) -> dict[str, dict[str, list[int]]]:
    """Each answer of ``answers`` (``{column: text}``) after the one ``prompt``, tokenized as TRL does (the module
    docstring): ``{column: {"input_ids", "completion_mask", TRUNCATED}}``, the mask 1 on the answer's tokens (EOS
    included). The prompt ends where the tokenized prompt and the shortest-agreeing whole sequence diverge, the same
    point for every answer (TRL's DPO takes the minimum over chosen and rejected). ``form`` is the row's
    :data:`FORMAT_COLUMN` (for :data:`CHAT` and :data:`WHOLE_CHAT` each answer is the whole rendered conversation).
    A prompt longer than ``max_prompt_length`` keeps its last tokens; a sequence longer than ``max_length`` loses
    its end: what was cut is :data:`TRUNCATED`'s flags, counted before training (:func:`~rlhf.data.collate.truncated_rows`).
    """
    if form not in FORMATS:
        raise ValueError(f"unknown row format {form!r}: one of {FORMATS}")
    chat = form != TEXT
    prompt_ids = [] if form == WHOLE_CHAT else tokens(tokenizer, prompt, chat)
    wholes = {column: tokens(tokenizer, answer if chat else prompt + _with_eos(tokenizer, answer), chat)
              for column, answer in answers.items()}
    shared = min((common_prefix_length(prompt_ids, ids) for ids in wholes.values()), default=len(prompt_ids))
    if shared < len(prompt_ids):
        _warn_once(tokenizer, prompt_ids[shared:])
    out = {}
    for column, ids in wholes.items():
        head, tail, cut = ids[:shared], ids[shared:], 0
        if max_prompt_length is not None and len(head) > max_prompt_length:
            head, cut = (head[-max_prompt_length:] if max_prompt_length > 0 else []), PROMPT_CUT
        input_ids, mask = head + tail, [0] * len(head) + [1] * len(tail)
        if max_length is not None and len(input_ids) > max_length:
            input_ids, mask, cut = input_ids[:max_length], mask[:max_length], cut | END_CUT
        out[column] = {"input_ids": input_ids, "completion_mask": mask, TRUNCATED: cut}
    return out


def encode(tokenizer, prompt: str, completion: str, max_prompt_length: int | None = None,
           max_length: int | None = None, form: str = TEXT) -> dict[str, list[int]]:
    """One answer: :func:`encode_answers` with ``{"completion": completion}``."""
    return encode_answers(tokenizer, prompt, {"completion": completion}, form, max_prompt_length,
                          max_length)["completion"]


def _warn_once(tokenizer, left_out: Sequence[int]) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    log.warning("the tokenized prompt is not a prefix of the tokenized prompt + answer (the chat template renders "
                "the prompt alone differently, or tokens merge across the boundary): the answer starts where they "
                "diverge, and this end of the prompt is not in the training sequence: %r. The model then trains on "
                "a context that differs from the one it generates from. Fix: a chat template that renders the prompt "
                "alike in both (model.chat_template), or prompts that end on a token boundary. Said once; it likely "
                "holds for every row.", tokenizer.decode(list(left_out)))

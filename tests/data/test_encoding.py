"""rlhf/data/encoding.py: prompt and answers tokenized as TRL 1.16 does (the whole sequence in one tokenization, the
answer from where it diverges from the prompt; EOS appended to plain text only). The same against TRL's trainers on a
real chat model: tests/models/test_real_model.py."""

from __future__ import annotations

import logging

import pytest

from rlhf.data import encoding
from rlhf.data.encoding import CHAT, TEXT, WHOLE_CHAT, common_prefix_length, encode, encode_answers
from rlhf.models.tokenizer import byte_tokenizer


def test_plain_text_appends_eos_and_masks_the_completion():
    tok = byte_tokenizer()
    out = encode(tok, "ab=", "ba")
    assert out["input_ids"] == [97, 98, 61, 98, 97, tok.eos_token_id]
    assert out["completion_mask"] == [0, 0, 0, 1, 1, 1]
    assert encode(tok, "ab=", "ba<eos>")["input_ids"] == out["input_ids"]  # an answer ending in EOS keeps one


def test_truncation_keeps_prompt_end_and_sequence_start():
    tok = byte_tokenizer()
    out = encode(tok, "abcdef=", "xyz", max_prompt_length=3, max_length=5)
    assert out["input_ids"] == list(b"ef=xy")
    assert out["completion_mask"] == [0, 0, 0, 1, 1]


class _MergingTokenizer:
    """Like a Llama BPE tokenizer: a leading BOS (id 1) with special tokens, "<s>" in text is BOS, "</s>" EOS (2), and
    "ab" one token (300) wherever it appears, across a prompt/answer boundary too."""

    bos_token, eos_token, eos_token_id = "<s>", "</s>", 2

    def __call__(self, text, add_special_tokens=True):
        ids = [1] if add_special_tokens else []
        while text:
            for piece, token in (("<s>", 1), ("</s>", 2), ("ab", 300)):
                if text.startswith(piece):
                    ids.append(token)
                    text = text[len(piece):]
                    break
            else:
                ids.append(ord(text[0]))
                text = text[1:]
        return {"input_ids": ids}

    def decode(self, ids):
        return "".join({1: "<s>", 2: "</s>", 300: "ab"}.get(i, chr(i)) if i < 1000 else "?" for i in ids)


def test_plain_text_gets_the_tokenizers_specials_once_and_the_whole_sequence_is_one_tokenization(caplog):
    tok = _MergingTokenizer()
    assert encode(tok, "xy", "c")["input_ids"] == [1, ord("x"), ord("y"), ord("c"), 2]
    assert encode(tok, "<s>xy", "c")["input_ids"] == [1, ord("x"), ord("y"), ord("c"), 2]  # rendered: BOS not doubled
    # "a" + "b": tokenized apart they would be [97] + [98]; as one sequence they merge, and the answer starts where
    # the two tokenizations diverge (TRL's common_prefix_length), saying once that the prompt's end is left out
    encoding._warned = False
    with caplog.at_level(logging.WARNING, logger="rlhf.data.encoding"):
        out = encode(tok, "xa", "bc")
        encode(tok, "ya", "bc")
    assert out["input_ids"] == [1, ord("x"), 300, ord("c"), 2]
    assert out["completion_mask"] == [0, 0, 1, 1, 1]
    assert [r.message.count("is not a prefix") for r in caplog.records] == [1]


def test_a_rendered_conversation_gets_no_specials_and_no_eos_and_pairs_share_one_prompt():
    tok = _MergingTokenizer()
    prompt, chosen, rejected = "<s>u:q\na:", "<s>u:q\na:yes\n", "<s>u:q\na:ab\n"
    out = encode_answers(tok, prompt, {"chosen": chosen, "rejected": rejected}, CHAT)
    assert out["chosen"]["input_ids"] == tok(chosen, add_special_tokens=False)["input_ids"]  # no BOS, no EOS added
    assert out["chosen"]["input_ids"][-1] == ord("\n")
    # the prompt ends where both sides still agree with it: the same number of prompt tokens on each side
    assert out["chosen"]["completion_mask"].index(1) == out["rejected"]["completion_mask"].index(1) == 7
    whole = encode(tok, "<s>u:q\na:", "<s>u:q\na:yes\n", form=WHOLE_CHAT)  # every token is trained
    assert whole["completion_mask"] == [1] * len(whole["input_ids"])


def test_a_pair_whose_sides_cut_the_prompt_differently_shares_the_shorter_cut_and_one_prompt(caplog):
    """The prompt "xa" ends on its own in the chosen sequence (x a c) but merges with the rejected answer's first
    letter ("ab" one token): chosen's own cut is 3 tokens, rejected's 2. Both sides start their answer at 2, the
    shorter (TRL's DPO takes the minimum), so the pair keeps one prompt, which the shared-prompt layout lays out once,
    and a prompt cut (max_prompt_length) cuts the same tokens from both (red: each side cut at its own point, the
    pair refused by the layout)."""
    import torch

    from rlhf.data import shared_prompt

    tok = _MergingTokenizer()
    own = {side: common_prefix_length(tok("xa")["input_ids"], tok(whole)["input_ids"])
           for side, whole in (("chosen", "xac</s>"), ("rejected", "xabc</s>"))}
    assert own == {"chosen": 3, "rejected": 2}
    encoding._warned = False
    with caplog.at_level(logging.WARNING, logger="rlhf.data.encoding"):
        out = encode_answers(tok, "xa", {"chosen": "c", "rejected": "bc"})
    assert out["chosen"]["input_ids"] == [1, ord("x"), ord("a"), ord("c"), 2]
    assert out["rejected"]["input_ids"] == [1, ord("x"), 300, ord("c"), 2]
    assert out["chosen"]["completion_mask"] == out["rejected"]["completion_mask"] == [0, 0, 1, 1, 1]
    assert "is not a prefix" in caplog.text  # chosen's "a" trains as answer, not prompt: said
    batch = shared_prompt.collate(*[[out[side][key]] for side in ("chosen", "rejected")
                                    for key in ("input_ids", "completion_mask")], pad_id=0)
    # the prompt's first token is shared; its last (x) begins each branch, then each answer: x a c </s> | x ab c </s>
    assert batch["input_ids"].tolist() == [[1, ord("x"), ord("a"), ord("c"), 2, ord("x"), 300, ord("c"), 2]]
    assert batch[shared_prompt.BRANCH_IDS].tolist() == [[0, 1, 1, 1, 1, 2, 2, 2, 2]]
    assert torch.equal(batch["completion_mask"], torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1]]))
    cut = encode_answers(tok, "xa", {"chosen": "c", "rejected": "bc"}, max_prompt_length=1)
    assert cut["chosen"]["input_ids"] == [ord("x"), ord("a"), ord("c"), 2]
    assert cut["rejected"]["input_ids"] == [ord("x"), 300, ord("c"), 2]
    assert cut["chosen"][encoding.TRUNCATED] == cut["rejected"][encoding.TRUNCATED] == encoding.PROMPT_CUT


def test_the_tiny_tokenizer_tokenizes_as_before_the_joint_tokenization():
    """The byte tokenizer merges nothing and adds no specials: one tokenization is prompt ids + answer ids + EOS,
    so the embedded task's tokens (and every figure measured on them) are what they were."""
    tok = byte_tokenizer()
    for prompt, answer in (("abc=", "cba"), ("", "x"), ("héllo =", "olléh")):
        apart = tok(prompt)["input_ids"] + tok(answer)["input_ids"] + [tok.eos_token_id]
        assert encode(tok, prompt, answer)["input_ids"] == apart


def test_common_prefix_length_and_an_unknown_format():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix_length([], [1]) == 0
    with pytest.raises(ValueError, match="unknown row format 'chatml'"):
        encode(byte_tokenizer(), "a", "b", form="chatml")
    assert TEXT in encoding.FORMATS

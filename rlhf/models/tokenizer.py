"""A byte-level tokenizer that needs no files, yet saves and reloads with `AutoTokenizer`.

Ids 0-255 are the bytes themselves, then `<pad>` 256, `<bos>` 257, `<eos>` 258. Nothing is added
automatically (no BOS), so "prompt + completion" tokenizes to the concatenation of the two parts.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
VOCAB_SIZE = 259

# A minimal chat template so that conversational datasets also work with the embedded model.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable-character map used by byte-level BPE (Radford et al., 2019, GPT-2)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """Build the byte tokenizer in memory."""
    char_of = _bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={char_of[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([PAD, BOS, EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE,
        padding_side="right",
    )

from transformers import AutoTokenizer

from rlhf.models.tokenizer import byte_tokenizer


def test_ids_are_bytes_then_specials():
    tok = byte_tokenizer()
    assert tok("az=")["input_ids"] == [97, 122, 61]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    assert tok.decode(list("é".encode())) == "é"


def test_saves_and_reloads_with_auto_tokenizer(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok("hello")["input_ids"] == list(b"hello")
    assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<|user|>\nx\n"

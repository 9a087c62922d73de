"""The SmolLM2 tokenizer against transformers' GGUF tokenizer, and the byte-level tokenizer."""

import os
import re
import unicodedata

import pytest

transformers = pytest.importorskip("transformers")

import tokenizers  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402

from checkpoints import Tokenizer, default_gguf_path, load_model  # noqa: E402
from tests.prompts import prompts  # noqa: E402


EXTRA = ["héllo wörld — naïve café, 日本語のテキスト, Россия, مرحبا 🙂👍🏽 x²³ ½",
         "In 2014, 12,345 apples cost $3.50 (about 1e-3 each).",
         "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name>x<file_sep>",
         "I'm sure they'll say it's fine, don't you think?\ttabs\r\nand  double  spaces  ",
         "x\n    0\n\n1  2"]


def _prompts() -> list[str]:
    return prompts() + EXTRA


@pytest.fixture(scope="module")
def toks():
    path = default_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return Tokenizer.from_gguf(path), ref


def _pretokenizers_disagree(text: str) -> bool:
    """Where transformers' GGUF tokenizer differs from SmolLM2's own, llama.cpp's and ours.

    transformers (5.24) ignores tokenizer.ggml.pre == "smollm" and splits with the GPT-2 regex
    alone, which glues one space to a following number: "\n    0" becomes "\n   ", " 0" instead of
    "\n    ", "0", and " ²" may merge to "Ġ" + "Â" bytes. After a single space an ASCII digit
    tokenizes the same either way (the vocabulary has no "Ġ<digit>" merges).
    """
    return any(unicodedata.category(c)[0] == "N" and i > 0 and text[i - 1].isspace()
               and (not c.isascii() or (i > 1 and text[i - 2].isspace())) for i, c in enumerate(text))


def test_ids_equal_transformers(toks):
    ours, ref = toks
    texts = [t for t in _prompts() if not _pretokenizers_disagree(t)]
    assert len(texts) >= 5 and any(re.search(r"\d", t) for t in texts)
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text[:200]


def test_ids_equal_smollm2_pretokenizer(toks):
    """With SmolLM2's published pre-tokenizer (individual digits, then GPT-2 byte-level) swapped
    into transformers' tokenizer, every prompt tokenizes identically."""
    ours, ref = toks
    fixed = tokenizers.Tokenizer.from_str(ref.backend_tokenizer.to_str())  # a copy
    fixed.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for text in _prompts():
        assert ours.encode(text) == fixed.encode(text, add_special_tokens=False).ids, text[:200]
    pieces = [ours.backend.id_to_token(i) for i in ours.encode("x\n    0")]
    assert pieces == ["x", "ĊĠĠĠĠ", "0"]  # llama.cpp's smollm rule: \p{N} split first


def test_chat_template_equals_transformers(toks):
    ours, ref = toks
    conversations = [
        [{"role": "user", "content": "What is 12 * 7?"}, {"role": "assistant", "content": "12 * 7 = 84."}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.encode(text) == ref.encode(text)
    ids = ours.encode(ours.apply_chat_template(conversations[0]))
    assert ids[0] == 1 and ids.count(1) == 4 and ids.count(2) == 3  # <|im_start|>, <|im_end|> kept whole


def test_special_ids_and_flags(toks):
    ours, ref = toks
    assert ours.bos_token_id == 1 and ours.vocab_size == 49152 == len(ref)
    # <|im_end|> (declared eos, ends each chat turn) and <|endoftext|> (ends documents).
    assert ours.eos_token_ids == (2, 0)
    assert ours.encode("Hi")[0] != ours.bos_token_id  # add_bos_token is False in the GGUF


def test_decode_round_trip(toks):
    ours, ref = toks
    for text in _prompts():
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_hf_dir_round_trip(toks, tmp_path):
    ours, _ = toks
    ours.save(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Hi 123"}]
    assert back.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert (back.bos_token_id, back.eos_token_ids[0]) == (1, 2)
    for text in _prompts()[:20] + EXTRA:
        assert back.encode(text) == ours.encode(text) == theirs.encode(text, add_special_tokens=False)


def test_byte_level():
    tok = Tokenizer.byte_level(300, bos_token_id=1, eos_token_ids=(2,))
    text = "héllo 🙂\n"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 2, 105, 299]) == "hi"  # eos skipped; ids past the bytes decode to nothing
    assert tok.vocab_size == 300 and tok.eos_token_ids == (2,)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size >= 256"):
        Tokenizer.byte_level(100)
    with pytest.raises(ValueError, match="accepted|expected"):
        load_model("not-a-model")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_hf_dir(tmp_path)
    tok = Tokenizer.byte_level(256)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])

"""Tokenizers: a thin wrapper over the `tokenizers` library plus the model's Jinja chat template.

Sources: the GGUF tokenizer keys (`tokenizer.ggml.*`) are specified in ggml's `docs/gguf.md`;
pre-tokenizer regexes follow llama.cpp's `llama-vocab.cpp` for each `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import datetime
import functools
import json
import os

import gguf
import jinja2
import jinja2.ext
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from checkpoints.gguf_loader import CONTROL, USER_DEFINED, eos_token_ids, field, open_reader

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> how text is split before BPE (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_*).
_PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    # smollm: "\p{N}" isolated first (every digit its own piece), then the GPT-2 regex;
    # identical to SmolLM2's tokenizer.json (Digits(individual_digits) + ByteLevel).
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


# Gemma's chat format (Gemma 2 and 3 model cards; what their `tokenizer_config.json` templates render for text):
# a system message joins the first user turn; the assistant's role is "model". No BOS here: `encode` adds it
# (the files set `add_bos_token`).
_GEMMA_TEMPLATE = (
    "{% set system = messages[0]['content'] + '\\n\\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for m in (messages[1:] if system else messages) %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (system if loop.first else '') + m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Chat templates of the architectures whose GGUF files may carry none.
_CHAT_TEMPLATES = {"gemma2": _GEMMA_TEMPLATE, "gemma3": _GEMMA_TEMPLATE}


def _sentencepiece_bpe(tokens: list[str], unk_id: int | None) -> tokenizers.Tokenizer:
    """A SentencePiece BPE vocabulary (spaces spelled "▁", byte pieces `<0xNN>`) as a `tokenizers` BPE with byte
    fallback. A GGUF lists no merges: each token's splits into two tokens of the vocabulary are merges, ranked by
    the token's place in the file (Gemma's files list pieces in merge order; their scores do not follow it),
    longer left part first — the rule transformers' GGUF reader uses for Gemma."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [(t[:k], t[k:]) for t in tokens for k in range(len(t) - 1, 0, -1) if t[:k] in vocab and t[k:] in vocab]
    unk = None if unk_id is None else tokens[int(unk_id)]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def _compile_template(source: str) -> jinja2.Template:
    # Mirrors transformers' environment so templates written for it render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


_BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# Texts (characters) and id lists longer than this go through the tokenizers library's batch calls,
# which release the GIL (its single calls hold it: 0.45 s for 1 MB of text, measured).
_LONG = 4096


class Tokenizer:
    """Text <-> token ids for one model, and its chat template.

    Build it with `from_gguf`, `from_hf_dir` or `byte_level`; ids are Python ints.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], add_bos_token: bool = False, vocab_size: int | None = None):
        self._tok = backend
        self._vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._bos = bos_token_id
        self._eos = tuple(eos_token_ids)
        self._add_bos = add_bos_token
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        ids = {backend.token_to_id(t) for t in special}
        # eos/bos are dropped from decoded text even when the backend does not mark them special
        # (the byte-level tokenizer, whose ids are plain bytes).
        self._skip = frozenset(ids | set(self._eos) | ({self._bos} if self._bos is not None else set()))

    # --- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader_or_path: gguf.GGUFReader | str | os.PathLike) -> "Tokenizer":
        """From `tokenizer.ggml.{model,tokens,merges,token_type,pre}`: byte-level BPE (`gpt2`), or
        SentencePiece BPE (`llama`) for the Gemma architectures (`_sentencepiece_bpe`).

        Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
        tokens, so both are matched whole in text. A file without `tokenizer.chat_template` gets its
        architecture's template where one is known (`_CHAT_TEMPLATES`). Raises ValueError for another
        tokenizer model, a SentencePiece vocabulary of another architecture, or an unknown pre-tokenizer.
        """
        r = open_reader(reader_or_path)
        kind, pre = field(r, "tokenizer.ggml.model"), field(r, "tokenizer.ggml.pre", "default")
        arch = field(r, "general.architecture")
        tokens = field(r, "tokenizer.ggml.tokens")
        types = field(r, "tokenizer.ggml.token_type", [1] * len(tokens))
        if kind == "llama" and arch in _CHAT_TEMPLATES:
            # Gemma files spell tokens of several spaces with real spaces: respelled with "▁" so merges reach
            # them (and not added whole, which would match raw spaces before the normalizer runs).
            spelled = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
            types = [ty if t == t0 else 1 for t, t0, ty in zip(spelled, tokens, types)]
            tokens = spelled
            backend = _sentencepiece_bpe(tokens, field(r, "tokenizer.ggml.unknown_token_id"))
        elif kind == "gpt2":
            if pre not in _PRE_TOKENIZERS:
                raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(_PRE_TOKENIZERS)}")
            merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges", [])]
            backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
            backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
            backend.decoder = decoders.ByteLevel()
        else:
            raise ValueError(f"tokenizer.ggml.model {kind!r} of architecture {arch!r} is not supported: byte-level "
                             f"BPE ('gpt2'), or SentencePiece BPE ('llama') of {', '.join(_CHAT_TEMPLATES)}")
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty == CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == USER_DEFINED])
        bos = field(r, "tokenizer.ggml.bos_token_id")
        return cls(backend, chat_template=field(r, "tokenizer.chat_template") or _CHAT_TEMPLATES.get(arch),
                   bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_token_ids(r),
                   add_bos_token=bool(field(r, "tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a Hugging Face directory: `tokenizer.json`, `tokenizer_config.json` and, if present,
        `chat_template.jinja`, `generation_config.json`/`config.json` (their `eos_token_id`s are added).

        Raises FileNotFoundError when there is no `tokenizer.json`.
        """
        file = os.path.join(os.fspath(path), "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        path, backend = os.fspath(path), tokenizers.Tokenizer.from_file(file)
        tc = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = tc.get("chat_template")
        if os.path.exists(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                template = f.read()
        to_id = lambda tok: backend.token_to_id(tok["content"] if isinstance(tok, dict) else tok) if tok else None
        eos = [to_id(tc.get("eos_token"))]
        for name in ("generation_config.json", "config.json"):
            e = _read_json(os.path.join(path, name)).get("eos_token_id")
            eos += e if isinstance(e, list) else [e]
        return cls(backend, chat_template=template, bos_token_id=to_id(tc.get("bos_token")),
                   eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
                   add_bos_token=bool(tc.get("add_bos_token", False)))

    @classmethod
    def byte_level(cls, vocab_size: int, *, bos_token_id: int | None = None,
                   eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        """UTF-8 bytes as ids 0..255 (for random-weight presets); ids >= 256 decode to nothing.

        Raises ValueError if `vocab_size < 256`.
        """
        if vocab_size < 256:
            raise ValueError(f"byte-level tokenizer needs vocab_size >= 256, got {vocab_size}")
        vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
        backend = tokenizers.Tokenizer(models.BPE(vocab, []))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        return cls(backend, chat_template=_BYTE_CHAT_TEMPLATE, bos_token_id=bos_token_id,
                   eos_token_ids=eos_token_ids, vocab_size=vocab_size)

    # --- use --------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token texts in it (e.g. `<|im_start|>`) map to their ids.
        BOS is prepended only when the model's tokenizer says to (`add_bos_token`)."""
        if len(text) > _LONG:  # the batch call releases the GIL: other threads run meanwhile
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self._bos] + ids if self._add_bos and self._bos is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if len(ids) > _LONG:  # numpy's loops and the batch call hold the GIL briefly: other threads run meanwhile
            ids = np.asarray(ids, np.int64)
            if skip_special_tokens:
                ids = ids[~np.isin(ids, np.fromiter(self._skip, np.int64, len(self._skip)))]
            return self._tok.decode_batch([ids.tolist()], skip_special_tokens=False)[0]
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skip]
        return self._tok.decode(ids, skip_special_tokens=False)

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text (None: the model has none)."""
        return self._tok.id_to_token(self._bos) if self._bos is not None else None

    @property
    def eos_token(self) -> str | None:
        """The first EOS token's text (None: the model has none)."""
        return self._tok.id_to_token(self._eos[0]) if self._eos else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}]) with the model's Jinja template in a
        sandbox. Raises ValueError if the model has no template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", **kwargs)

    def with_eos_token_ids(self, eos_token_ids: tuple[int, ...]) -> "Tokenizer":
        return Tokenizer(self._tok, chat_template=self.chat_template, bos_token_id=self._bos,
                         eos_token_ids=eos_token_ids, add_bos_token=self._add_bos, vocab_size=self._vocab_size)

    def save(self, path: str | os.PathLike) -> None:
        """Writes `tokenizer.json` and `tokenizer_config.json` (readable by `from_hf_dir` and transformers)."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self._tok.save(os.path.join(path, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": self.chat_template,
                  "add_bos_token": self._add_bos, "bos_token": self.bos_token, "eos_token": self.eos_token}
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size V (for the byte-level tokenizer, ids >= 256 are unused)."""
        return self._vocab_size

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)

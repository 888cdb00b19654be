"""Tokenizers built from GGUF metadata, behaving like llama.cpp's llama-vocab.cpp.

Two families are implemented:

* "llama" (SentencePiece-style): spaces become U+2581, a space is prefixed
  to text that starts the prompt or follows a special token when
  add_space_prefix is set, then adjacent symbols are merged greedily by the
  score of the token they form (highest first, leftmost on ties); symbols
  that never form a token fall back to <0xXX> byte tokens.
* "gpt2" (byte-level BPE): the text is cut into words by the pre-tokenizer
  regexes that `tokenizer.ggml.pre` names (each regex splits the pieces the
  previous one left, keeping the unmatched gaps), each word is mapped byte by
  byte to GPT-2's printable alphabet, then pairs are merged by merge rank.

Special tokens (control, user-defined, unknown) are cut out of the text
first, longest first; control and unknown ones only when parse_special.
A model named Phi-3 (general.name) drops the whitespace after most of them,
as llama.cpp does (it sets their RSTRIP attribute by that name alone).
"""

from __future__ import annotations

import codecs
import heapq
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import regex

from edgetp.model.chat import render_chat_template

log = logging.getLogger(__name__)

SPACE = "\u2581"  # SentencePiece's escaped space


class UnsupportedTokenizer(ValueError):
    """The GGUF names a tokenizer model or pre-tokenizer edgetp does not implement."""


class Attr:
    """llama.cpp's llama_token_attr bits (plain ints: an IntFlag's & and | cost a 49k-token
    vocabulary ~0.3 s at every start, a third of building its tokenizer)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    RSTRIP = 1 << 8  # whitespace after the token is dropped when it is cut out of the text


# tokenizer.ggml.token_type values (gguf's TokenType) -> attributes
_TYPE_TO_ATTR = {1: Attr.NORMAL, 2: Attr.UNKNOWN, 3: Attr.CONTROL, 4: Attr.USER_DEFINED, 5: Attr.UNUSED, 6: Attr.BYTE}
_SPECIAL = Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN
_HIDDEN = Attr.CONTROL | Attr.UNKNOWN  # rendered as nothing unless specials are asked for
_C_SPACE = " \t\n\v\f\r"  # C's isspace, which llama.cpp's RSTRIP uses
_MARK = "\ufdd0"  # a Unicode noncharacter: breaks a control token's text in chat content until it is encoded

# -- pre-tokenizers (llama.cpp llm_tokenizer_bpe) --------------------------------------------
# llama.cpp runs the GPT-2 expression through a hand-written matcher that also takes
# whitespace the expression leaves unmatched (a trailing "|\s+"); the others it runs as
# regexes. Unmatched gaps between matches are kept as words either way.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?(?:(?=[\p{L}])[^a-z])*(?:(?=[\p{L}])[^A-Z])+"
    r"|[^\r\n\p{L}\p{N}]?(?:(?=[\p{L}])[^a-z])+(?:(?=[\p{L}])[^A-Z])*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-4o, Phi-4-mini) as llama.cpp rewrites it: its letter classes become "a letter not a-z/A-Z"
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?(?:(?=[\p{L}])[^a-z])*(?:(?=[\p{L}])[^A-Z])+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?(?:(?=[\p{L}])[^a-z])+(?:(?=[\p{L}])[^A-Z])*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    exprs: tuple[str, ...]
    ignore_merges: bool = False  # a word that is already a token skips merging
    add_bos: bool = False  # llama.cpp's default before tokenizer.ggml.add_bos_token


_PRE_GROUPS: list[tuple[tuple[str, ...], PreTokenizer]] = [
    (("default",), PreTokenizer(_DEFAULT)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling"), PreTokenizer((_GPT2,))),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     PreTokenizer((r"\p{N}", _GPT2))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan", "solar-open"),
     PreTokenizer((_QWEN2,))),
    (("tekken",), PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o",), PreTokenizer((_GPT4O,))),
]
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _PRE_GROUPS for name in names}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (byte i maps to table[i])."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_ENCODER = _bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in enumerate(BYTE_ENCODER)}
_BYTE_CHARS = frozenset(BYTE_DECODER)
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in BYTE_DECODER.items()})  # GPT-2's alphabet -> its bytes as latin-1

# -- token attributes llama.cpp infers from token text -----------------------------------------
_EOT_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"}
_FIM_TEXTS = {
    "pre": {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
            "<|prefix|>"},
    "suf": {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
            "<|suffix|>"},
    "mid": {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
            "<|middle|>"},
    "pad": {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"},
    "rep": {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"},
    "sep": {"<|file_sep|>"},
}
_FIM_BY_TEXT = {text: [f"fim_{part}" for part, texts in _FIM_TEXTS.items() if text in texts]
                for text in set().union(*_FIM_TEXTS.values())}
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~["}
_ALWAYS_RENDERED = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}  # gpt-oss


class _Vocab:
    """Token texts, scores and attributes, and llama.cpp's special ids and EOG set."""

    def __init__(self, meta: Mapping[str, Any], kind: str) -> None:
        tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
        n = len(tokens)
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.ids: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            if self.ids.setdefault(t, i) != i:
                log.warning("duplicate token %r at ids %d and %d; keeping the first", t, self.ids[t], i)
        scores = meta.get("tokenizer.ggml.scores")
        self.scores = [float(s) for s in scores] if scores is not None else [0.0] * n
        types = meta.get("tokenizer.ggml.token_type")
        self.attrs = [_TYPE_TO_ATTR.get(int(t), Attr.UNDEFINED) for t in types] if types is not None else [Attr.NORMAL] * n

        defaults = {"bos": 1, "eos": 2, "unk": 0} if kind == "spm" else {"bos": 11, "eos": 11}
        key = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding", "eot": "eot", "eom": "eom",
               "fim_pad": "fim_pad", "fim_rep": "fim_rep", "fim_sep": "fim_sep"}
        self.special: dict[str, int | None] = {}
        for name, short in key.items():
            tid = defaults.get(name)
            if tid is not None and tid >= n:
                tid = None
            given = meta.get(f"tokenizer.ggml.{short}_token_id")
            if given is not None and 0 <= int(given) < n:
                tid = int(given)
            self.special[name] = tid
        self._infer_attributes()
        self.eog = self._end_of_generation()
        self._attributes_by_name(str(meta.get("general.name") or "").lower())

    def _mark_control(self, tid: int) -> None:
        self.attrs[tid] |= Attr.CONTROL

    def _infer_attributes(self) -> None:
        sp = self.special
        for tid, text in enumerate(self.tokens):
            if self.ids[text] != tid:
                continue
            if sp["eot"] is None and text in _EOT_TEXTS:
                sp["eot"] = tid
                self._mark_control(tid)
            if sp["eom"] is None and text == "<|eom_id|>":
                sp["eom"] = tid
                self._mark_control(tid)
            for name in _FIM_BY_TEXT.get(text, ()):
                if sp.get(name) is None:
                    sp[name] = tid
                    self._mark_control(tid)
        for tid, text in enumerate(self.tokens):
            if self.attrs[tid] & Attr.CONTROL and "unused" in text:
                self.attrs[tid] |= Attr.UNUSED

    def _attributes_by_name(self, name: str) -> None:
        """llama.cpp's "set attributes by model/tokenizer name": a Phi-3 drops the whitespace after
        every special token but <unk>, <s> and <|endoftext|> (HF's tokenizer has rstrip on them)."""
        if "phi-3" not in name and "phi3" not in name:
            return
        for tid in range(len(self.tokens)):
            if self.attrs[tid] & _SPECIAL or self.tokens[tid] == "</s>":
                self.attrs[tid] |= Attr.RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in self.ids:
                self.attrs[self.ids[text]] &= ~Attr.RSTRIP

    def _end_of_generation(self) -> set[int]:
        sp = self.special
        eog = {sp[k] for k in ("fim_pad", "fim_rep", "fim_sep") if sp[k] is not None}
        for tid, text in enumerate(self.tokens):
            if text in _EOG_TEXTS:
                eog.add(tid)
                self._mark_control(tid)
            if text in _ALWAYS_RENDERED:
                self.attrs[tid] = Attr.USER_DEFINED
        eog |= {sp[k] for k in ("eos", "eot", "eom") if sp[k] is not None}
        texts = {self.tokens[t]: t for t in eog}
        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts.keys() or
                                   {"<|calls|>", "<|flush|>"} <= texts.keys()):
            eog.discard(texts["<|end|>"])
            self.attrs[texts["<|end|>"]] = Attr.USER_DEFINED
        if "<|tool_response>" in texts and "</s>" in texts:  # gemma4
            eog.discard(texts["</s>"])
            self.attrs[texts["</s>"]] = Attr.NORMAL
        return eog


class Tokenizer:
    """Text <-> token ids for one GGUF model; see the module docstring."""

    def __init__(self, meta: Mapping[str, Any]) -> None:
        model = meta.get("tokenizer.ggml.model")
        if model == "llama":
            self.kind = "spm"
        elif model == "gpt2":
            self.kind = "bpe"
        else:
            raise UnsupportedTokenizer(f"tokenizer model {model!r} is not supported (edgetp knows 'llama', 'gpt2')")
        if "tokenizer.ggml.tokens" not in meta:
            raise UnsupportedTokenizer("GGUF has no tokenizer.ggml.tokens")
        v = _Vocab(meta, self.kind)
        self._v = v
        self.tokens: list[str] = v.tokens
        self.vocab_size = len(v.tokens)
        self.bos_id: int | None = v.special["bos"]
        self.eos_id: int | None = v.special["eos"]
        self.unk_id: int | None = v.special["unk"]
        self.pad_id: int | None = v.special["pad"]
        self.eot_id: int | None = v.special["eot"]
        self.eom_id: int | None = v.special["eom"]
        self.stop_ids: frozenset[int] = frozenset(v.eog)
        self.chat_template: str | None = meta.get("tokenizer.chat_template")

        if self.kind == "bpe":
            pre_name = meta.get("tokenizer.ggml.pre") or "default"
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise UnsupportedTokenizer(f"BPE pre-tokenizer {pre_name!r} is not supported "
                                           f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
            if "tokenizer.ggml.merges" not in meta:
                raise UnsupportedTokenizer("gpt2 tokenizer without tokenizer.ggml.merges")
            self.pre_name = pre_name
            self._exprs = [regex.compile(e) for e in pre.exprs]
            self._ignore_merges = pre.ignore_merges
            self._ranks: dict[tuple[str, str], int] = {}
            for rank, merge in enumerate(meta["tokenizer.ggml.merges"]):
                cut = merge.find(" ", 1)
                pair = (merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", "")
                self._ranks.setdefault(pair, rank)
            add_bos, add_space_prefix = pre.add_bos, False
        else:
            self.pre_name = "spm"
            add_bos, add_space_prefix = True, True
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos and self.bos_id is None:
            raise UnsupportedTokenizer("add_bos_token is set but the model has no BOS token")
        if self.add_eos and self.eos_id is None:
            raise UnsupportedTokenizer("add_eos_token is set but the model has no EOS token")

        # special tokens, longest (in bytes) first, as llama.cpp searches them
        special = [t for t in range(self.vocab_size) if v.attrs[t] & _SPECIAL]
        self._specials = sorted(special, key=lambda t: -len(self.tokens[t].encode()))
        self._pieces = [self._piece(t) for t in range(self.vocab_size)]
        self._hidden = [bool(v.attrs[t] & _HIDDEN) for t in range(self.vocab_size)]
        self._word_cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """meta: {name: field.contents()} of a gguf.GGUFReader."""
        return cls(meta)

    # -- lookups -------------------------------------------------------------------------
    def token_id(self, text: str) -> int | None:
        return self._v.ids.get(text)

    def starts_with_bos(self, text: str) -> bool:
        """Whether `text` (say a rendered chat template) already opens with the
        BOS token's text, so encoding it with add_special would double the BOS."""
        return self.bos_id is not None and text.startswith(self.tokens[self.bos_id])

    # -- encode --------------------------------------------------------------------------
    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama_tokenize(text, add_special, parse_special): BOS/EOS added when
        add_special and the model asks for them; control-token text is
        recognised as that token only when parse_special."""
        return self._encode(self._partition(text, parse_special), add_special)

    def _encode(self, frags: list[str | int], add_special: bool) -> list[int]:
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        prev_special = True  # SPM: text at the start gets the space prefix too
        for frag in frags:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif self.kind == "spm":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm(frag.replace(" ", SPACE), out)
                prev_special = False
            else:
                for word in self._split(frag):
                    out.extend(self._bpe_word(word))
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        frags: list[str | int] = [text] if text else []
        for tid in self._specials:
            if not parse_special and self._v.attrs[tid] & _HIDDEN:
                continue
            needle = self.tokens[tid]
            if not any(isinstance(f, str) and needle in f for f in frags):
                continue
            rstrip = bool(self._v.attrs[tid] & Attr.RSTRIP)
            split: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or needle not in f:
                    split.append(f)
                    continue
                for i, part in enumerate(f.split(needle)):
                    if i:
                        split.append(tid)
                        if rstrip:
                            part = part.lstrip(_C_SPACE)
                    if part:
                        split.append(part)
            frags = split
        return frags

    def _byte_token(self, b: int) -> int | None:
        tid = self._v.ids.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self._v.ids.get(chr(b))
        return tid if tid is not None else self.unk_id

    def _spm(self, text: str, out: list[int]) -> None:
        """Greedy merges by token score over the characters of `text`."""
        syms = list(text)
        n = len(syms)
        if not n:
            return
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        ids, scores = self._v.ids, self._v.scores
        heap: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            tid = ids.get(syms[left] + syms[right])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, len(syms[left]) + len(syms[right])))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
                continue
            syms[left] += syms[right]
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            if prv[left] >= 0:
                push(prv[left], left)
            if nxt[left] >= 0:
                push(left, nxt[left])
        i = 0
        while i != -1:
            tid = ids.get(syms[i])
            if tid is not None:
                out.append(tid)
            else:
                out.extend(t for t in map(self._byte_token, syms[i].encode()) if t is not None)
            i = nxt[i]

    def _split(self, text: str) -> list[str]:
        """Pre-tokenize: each expression splits every piece the previous one left."""
        pieces = [text]
        for expr in self._exprs:
            cut: list[str] = []
            for piece in pieces:
                pos = 0
                for m in expr.finditer(piece):
                    if m.start() > pos:
                        cut.append(piece[pos:m.start()])
                    if m.end() > m.start():
                        cut.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    cut.append(piece[pos:])
            pieces = cut
        return pieces

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        hit = self._word_cache.get(word)
        if hit is None:
            hit = self._bpe("".join(BYTE_ENCODER[b] for b in word.encode()))
            if len(self._word_cache) >= 100_000:
                self._word_cache.clear()
            self._word_cache[word] = hit
        return hit

    def _bpe(self, word: str) -> tuple[int, ...]:
        """Merge the lowest-ranked adjacent pair (leftmost on ties) until none is left."""
        ids, ranks = self._v.ids, self._ranks
        if self._ignore_merges and word in ids:
            return (ids[word],)
        syms = list(word)
        n = len(syms)
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, str]] = []

        def push(left: int, right: int) -> None:
            rank = ranks.get((syms[left], syms[right]))
            if rank is not None:
                heapq.heappush(heap, (rank, left, right, syms[left] + syms[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != text:
                continue
            syms[left] = text
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            if prv[left] >= 0:
                push(prv[left], left)
            if nxt[left] >= 0:
                push(left, nxt[left])
        out: list[int] = []
        i = 0 if n else -1
        while i != -1:
            tid = ids.get(syms[i])
            if tid is not None:
                out.append(tid)
            else:  # llama.cpp looks each byte up as a one-byte token; only ASCII can match
                out.extend(ids[chr(b)] for b in syms[i].encode() if b < 0x80 and chr(b) in ids)
            i = nxt[i]
        return tuple(out)

    # -- decode --------------------------------------------------------------------------
    def _piece(self, tid: int) -> bytes:
        """llama_token_to_piece(tid, special=True)."""
        text, attr = self.tokens[tid], self._v.attrs[tid]
        if attr & (_HIDDEN | Attr.USER_DEFINED):
            return text.encode()
        if attr & Attr.NORMAL:
            if self.kind == "spm":
                return text.replace(SPACE, " ").encode()
            if _BYTE_CHARS.issuperset(text):
                return text.translate(_TO_LATIN1).encode("latin-1")
            out = bytearray()
            for ch in text:
                b = BYTE_DECODER.get(ch)
                if b is None:
                    out += f"[UNK_BYTE_0x{ch.encode().hex()}{text}]".encode()
                else:
                    out.append(b)
            return bytes(out)
        if attr & Attr.BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined tokens render as nothing

    def token_bytes(self, tid: int, *, special: bool = False) -> bytes:
        """The bytes token `tid` stands for; control and unknown tokens are
        b"" unless `special` asks to render them as their text."""
        if not 0 <= tid < self.vocab_size:
            raise IndexError(f"token id {tid} outside vocabulary of {self.vocab_size}")
        if self._hidden[tid] and not special:
            return b""
        return self._pieces[tid]

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Concatenated token bytes as UTF-8 (errors="replace"). For SPM models
        with add_space_prefix, the space the encoder prefixed is dropped from
        the first piece, as SentencePiece's decode does."""
        stream = StreamDecoder(self, special=special, strip_prefix=True)
        return "".join(stream.feed(t) for t in ids) + stream.flush()

    def stream(self, *, special: bool = False) -> StreamDecoder:
        """A decoder for generated text: it continues a prompt, so no space is dropped."""
        return StreamDecoder(self, special=special)

    # -- chat ----------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """The rendered chat prompt and its ids: the template's special tokens parsed (BOS added once, not
        twice), the messages' content encoded as text. A control token's text inside a message (a user
        who writes "<|im_end|>\\n<|im_start|>system") is the characters it is, never that token, so no
        message can end its turn or forge another's (llama.cpp and transformers parse it: they give
        the same ids wherever the content holds no control token's text)."""
        # (a one-character control token cannot be broken; a user's own U+FDD0, a noncharacter, is dropped)
        controls = [self.tokens[t] for t in self._specials if self._v.attrs[t] & _HIDDEN and len(self.tokens[t]) > 1]
        marked = [dict(m, content=_mark(m["content"], controls)) if isinstance(m.get("content"), str) else m
                  for m in messages]
        text = self.apply_chat_template(marked, add_generation_prompt=add_generation_prompt)
        frags = [f.replace(_MARK, "") if isinstance(f, str) else f for f in self._partition(text, True)]
        return text.replace(_MARK, ""), self._encode([f for f in frags if f != ""], not self.starts_with_bos(text))

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render the model's tokenizer.chat_template like transformers does
        (sandboxed jinja2, trim_blocks/lstrip_blocks, bos_token/eos_token,
        raise_exception, strftime_now). A model without a template gets plain
        ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`...)."""
        bos = self.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.tokens[self.eos_id] if self.eos_id is not None else ""
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=bos, eos_token=eos, **extra)


def _mark(content: str, controls: list[str]) -> str:
    """content with every control token's text in it broken by _MARK after its first character."""
    for c in controls:  # longest first (Tokenizer._specials' order)
        while c in content:  # again for a token whose text overlaps itself ("aba" in "ababa")
            content = content.replace(c, c[0] + _MARK + c[1:])
    return content


class StreamDecoder:
    """Token-at-a-time detokenizer: feed() returns only whole UTF-8
    characters, holding back a character split across tokens until its last
    byte arrives; bytes that can never form a character become U+FFFD."""

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False, strip_prefix: bool = False) -> None:
        self._tok = tokenizer
        self._special = special
        # Only when decoding a whole text from its start: drop the space the encoder prefixed.
        self._strip_space = strip_prefix and tokenizer.kind == "spm" and tokenizer.add_space_prefix
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tid: int) -> str:
        data = self._tok.token_bytes(tid, special=self._special)
        if self._strip_space and data:
            self._strip_space = False
            if data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

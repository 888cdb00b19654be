"""The tokenizers and chat templates of Gemma, Qwen3 and Phi-3, against llama.cpp and the model cards.

No Gemma, Qwen or Phi file can be had offline, so each family's tokenizer is built from
a vocabulary we have, with the settings and special tokens that family's GGUF carries
(as llama.cpp's convert_hf_to_gguf.py writes them):

- gemma: SentencePiece with byte fallback (stories260K's vocabulary and its <0xXX>
  tokens), no space prefix (add_space_prefix false), <bos>/<eos>/<pad> and the control
  tokens <start_of_turn>/<end_of_turn>, and pieces for newlines, tabs and runs of spaces;
- qwen3: byte-level BPE (SmolLM2's vocabulary and merges) with the qwen2 pre-tokenizer,
  no BOS added, ChatML's <|im_start|>/<|im_end|>/<|endoftext|> and the added (not
  special, so user-defined) <think>, </think>, <tool_call>, </tool_call>;
- phi4-mini (architecture phi3 too): byte-level BPE (SmolLM2's) with the gpt-4o (o200k)
  pre-tokenizer and Phi-4-mini's control tokens, no BOS added;
- phi3: SentencePiece (stories260K) with Phi-3's control tokens <|endoftext|>, <|user|>,
  <|assistant|>, <|system|>, <|end|>, <|placeholder1|>. llama.cpp drops the whitespace after
  Phi-3's special tokens (but <unk>, <s>, <|endoftext|>) when the model's general.name holds
  "phi3" or "phi-3", and only then: both namings are checked.

Ids must equal llama.cpp's on test_tokenizer's hard strings and on each family's chat text,
and end-of-generation ids and every token's piece must too. The chat templates are the
models' published ones (Gemma 2's and Gemma 3's from test_gemma; Qwen3's and Phi-3's below),
rendered through our jinja2 path and compared with the turns written out by hand from
each model card.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf import TokenType

from edgetp.model.tokenizer import Tokenizer
from tests.test_gemma import GEMMA2_TEMPLATE, GEMMA3_TEMPLATE
from tests.test_tokenizer import HARD_STRINGS, _metadata, _write_vocab_gguf, llama_piece

# Qwen3's chat template as its tokenizer_config.json (and so its GGUF) carries it
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Phi-3-mini-4k-instruct's chat template (tokenizer_config.json)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

# Phi-4-mini-instruct's chat template (tokenizer_config.json): no newlines between the turns
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is "
    "not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + "
    "'<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")

_C, _U, _N = int(TokenType.CONTROL), int(TokenType.USER_DEFINED), int(TokenType.NORMAL)
_S, _B = gguf.GGUFValueType.STRING, gguf.GGUFValueType.BOOL
_ARR, _U32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32

# family -> (base vocabulary, renamed ids, appended (text, type), other keys)
FAMILIES = {
    "gemma": ("stories", {1: "<bos>", 2: "<eos>"},
              [("<pad>", _C), ("<start_of_turn>", _C), ("<end_of_turn>", _C),
               ("\n", _N), ("\n\n", _N), ("\t", _N), ("▁▁", _N), ("▁▁▁▁", _N)],
              {"tokenizer.ggml.add_space_prefix": (False, _B), "tokenizer.chat_template": (GEMMA2_TEMPLATE, _S),
               "general.name": ("Gemma 2 2b It", _S)}),
    "qwen3": ("smollm2", {}, [("<think>", _U), ("</think>", _U), ("<tool_call>", _U), ("</tool_call>", _U)],
              {"tokenizer.ggml.pre": ("qwen2", _S), "tokenizer.ggml.add_bos_token": (False, _B),
               "tokenizer.ggml.bos_token_id": (0, _U32), "tokenizer.ggml.eos_token_id": (2, _U32),
               "tokenizer.chat_template": (QWEN3_TEMPLATE, _S), "general.name": ("Qwen3 0.6B", _S)}),
    "phi3": ("stories", {},
             [("<|endoftext|>", _C), ("<|assistant|>", _C), ("<|placeholder1|>", _C), ("<|system|>", _C),
              ("<|end|>", _C), ("<|user|>", _C)],
             {"tokenizer.chat_template": (PHI3_TEMPLATE, _S), "general.name": ("Phi3", _S),
              "tokenizer.ggml.eos_token_id": (512, _U32)}),  # <|endoftext|>, the first id past stories260K's 512
}
FAMILIES["phi4-mini"] = ("smollm2", {}, [("<|assistant|>", _C), ("<|end|>", _C), ("<|system|>", _C), ("<|user|>", _C),
                                          ("<|tool|>", _C), ("<|/tool|>", _C)],
                          {"tokenizer.ggml.pre": ("gpt-4o", _S), "tokenizer.ggml.add_bos_token": (False, _B),
                           "tokenizer.ggml.bos_token_id": (0, _U32), "tokenizer.ggml.eos_token_id": (0, _U32),
                           "tokenizer.chat_template": (PHI4_MINI_TEMPLATE, _S),
                           "general.name": ("Phi 4 Mini Instruct", _S)})
FAMILIES["phi3-unnamed"] = FAMILIES["phi3"][:3] + (FAMILIES["phi3"][3] | {"general.name": ("Mini 4k Instruct", _S)},)

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CHATS = [
    [{"role": "user", "content": "Hello, who are you?"}],
    [{"role": "user", "content": " Hi there \n"}, {"role": "assistant", "content": "Hello!  How can I help?\n"},
     {"role": "user", "content": "What is 2+2?\n\nThink step by step."}],
]


@pytest.fixture(scope="module")
def families(llama_cpp, stories_path: Path, smollm2_path: Path, tmp_path_factory) -> dict:
    """family -> (our Tokenizer, llama.cpp's vocab-only Llama) on one written vocabulary GGUF."""
    readers = {"stories": gguf.GGUFReader(stories_path), "smollm2": gguf.GGUFReader(smollm2_path)}
    out, made = tmp_path_factory.mktemp("families"), {}
    for family, (base, renamed, added, keys) in FAMILIES.items():
        meta = _metadata(readers[base])
        tokens = [renamed.get(i, t) for i, t in enumerate(meta["tokenizer.ggml.tokens"])] + [t for t, _ in added]
        overrides = dict(keys)
        overrides["tokenizer.ggml.tokens"] = (tokens, _ARR)
        overrides["tokenizer.ggml.token_type"] = ([int(t) for t in meta["tokenizer.ggml.token_type"]]
                                                  + [kind for _, kind in added], _ARR)
        if "tokenizer.ggml.scores" in meta:  # appended pieces score above any other: merged first
            overrides["tokenizer.ggml.scores"] = ([float(s) for s in meta["tokenizer.ggml.scores"]]
                                                  + [1.0] * len(added), _ARR)
        path = out / f"{family}.gguf"
        _write_vocab_gguf(readers[base], path, overrides)
        tok = Tokenizer.from_metadata(_metadata(gguf.GGUFReader(path)))
        made[family] = tok, llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return made


def _chat_texts(tok: Tokenizer) -> list[str]:
    texts = []
    for chat in CHATS:
        for messages in (chat, [SYSTEM] + chat):
            for gen in (True, False):
                try:
                    texts.append(tok.apply_chat_template(messages, add_generation_prompt=gen))
                except ValueError:  # Gemma 2 refuses a system turn (test_gemma)
                    pass
    return texts


@pytest.mark.llamacpp
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ids_equal_llamacpps_on_the_hard_strings_and_the_familys_chat_text(families, family):
    tok, llm = families[family]
    texts = HARD_STRINGS + _chat_texts(tok)
    for text in texts:
        for add_special in (True, False):
            for parse_special in (False, True):
                want = llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)
                assert tok.encode(text, add_special=add_special, parse_special=parse_special) == want, (
                    text, add_special, parse_special)


@pytest.mark.llamacpp
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_end_of_generation_ids_and_every_piece_equal_llamacpps(llama_cpp, families, family):
    tok, llm = families[family]
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert tok.stop_ids == {t for t in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    for special in (False, True):
        assert [t for t in range(tok.vocab_size)
                if tok.token_bytes(t, special=special) != llama_piece(llama_cpp, llm, t, special)] == []


@pytest.mark.llamacpp
def test_phi3_drops_the_whitespace_after_its_special_tokens_only_when_named_phi3(families):
    text = "<|user|>\nHi<|end|>\n<|assistant|>\n"
    named, unnamed = families["phi3"][0], families["phi3-unnamed"][0]
    user, end, assistant = (named.token_id(t) for t in ("<|user|>", "<|end|>", "<|assistant|>"))
    # named: the newlines go, and "Hi" is a fragment of its own (with SentencePiece's space prefix)
    assert named.encode(text, add_special=False, parse_special=True) == [
        user, *named.encode("Hi", add_special=False), end, assistant]
    assert unnamed.encode(text, add_special=False, parse_special=True) != named.encode(
        text, add_special=False, parse_special=True)
    for family in ("phi3", "phi3-unnamed"):
        tok, llm = families[family]
        assert tok.encode(text, parse_special=True) == llm.tokenize(text.encode(), add_bos=True, special=True)


@pytest.mark.llamacpp
@pytest.mark.parametrize("family", ["gemma", "qwen3", "phi3", "phi4-mini"])
def test_an_encoded_chat_has_one_bos_where_the_family_wants_one_as_llamacpp_tokenizes_it(families, family):
    tok, llm = families[family]
    text, ids = tok.encode_chat(CHATS[1])
    assert ids == llm.tokenize(text.encode(), add_bos=not tok.starts_with_bos(text), special=True)
    bos_count = ids.count(tok.bos_id)
    assert bos_count == (0 if family in ("qwen3", "phi4-mini") else 1), ids[:4]


# ---------------------------------------------------------------- the model cards' formats, by hand


def _chat(tok: Tokenizer, messages, **kw) -> str:
    return tok.apply_chat_template(messages, **kw)


def test_gemma2_renders_user_and_model_turns_as_its_model_card_shows(families):
    tok = families["gemma"][0]
    assert _chat(tok, [{"role": "user", "content": "Write me a poem about Machine Learning."}]) == (
        "<bos><start_of_turn>user\nWrite me a poem about Machine Learning.<end_of_turn>\n<start_of_turn>model\n")
    assert _chat(tok, CHATS[1], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!  How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?\n\nThink step by step.<end_of_turn>\n")


def test_gemma3_folds_a_system_turn_into_the_first_user_turn(families):
    tok = families["gemma"][0]
    from edgetp.model.chat import render_chat_template  # noqa: PLC0415

    got = render_chat_template(GEMMA3_TEMPLATE, [SYSTEM, {"role": "user", "content": "Hi"}], bos_token="<bos>")
    assert got == ("<bos><start_of_turn>user\nYou are a helpful assistant.\n\nHi<end_of_turn>\n"
                   "<start_of_turn>model\n")
    assert tok.bos_id is not None and tok.tokens[tok.bos_id] == "<bos>"


def test_qwen3_renders_system_user_and_the_generation_prompt_as_its_model_card_shows(families):
    tok = families["qwen3"][0]
    messages = [SYSTEM, {"role": "user", "content": "Give me a short introduction to large language models."}]
    want = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nGive me a short introduction to large language models.<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert _chat(tok, messages) == want
    # enable_thinking=False: the template writes an empty think block for the model
    assert _chat(tok, messages, enable_thinking=False) == want + "<think>\n\n</think>\n\n"
    assert _chat(tok, messages[1:], add_generation_prompt=False) == (
        "<|im_start|>user\nGive me a short introduction to large language models.<|im_end|>\n")


def test_qwen3_drops_the_thinking_of_turns_before_the_last_question(families):
    tok = families["qwen3"][0]
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
                {"role": "user", "content": "And 3+3?"}]
    assert _chat(tok, messages) == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                                    "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")


def test_phi3_renders_system_user_and_the_generation_prompt_as_its_model_card_shows(families):
    tok = families["phi3"][0]
    messages = [SYSTEM, {"role": "user", "content": "How to explain Internet for a medieval knight?"}]
    assert _chat(tok, messages) == ("<|system|>\nYou are a helpful assistant.<|end|>\n"
                                    "<|user|>\nHow to explain Internet for a medieval knight?<|end|>\n"
                                    "<|assistant|>\n")
    # without a generation prompt the template closes with the EOS token, <|endoftext|>
    assert _chat(tok, messages[1:], add_generation_prompt=False) == (
        "<|user|>\nHow to explain Internet for a medieval knight?<|end|>\n<|endoftext|>")


def test_phi4_mini_renders_its_turns_without_newlines_as_its_model_card_shows(families):
    tok = families["phi4-mini"][0]
    messages = [SYSTEM, {"role": "user", "content": "How to explain Internet for a medieval knight?"}]
    assert _chat(tok, messages) == ("<|system|>You are a helpful assistant.<|end|>"
                                    "<|user|>How to explain Internet for a medieval knight?<|end|><|assistant|>")
    assert _chat(tok, messages[1:], add_generation_prompt=False) == (
        "<|user|>How to explain Internet for a medieval knight?<|end|><|endoftext|>")

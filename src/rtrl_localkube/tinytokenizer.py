"""The tiny model's tokenizer (:mod:`rtrl_localkube.tinymodel`): byte-level, built offline
with the ``tokenizers`` library, with a chat template in the Hermes tool-call format.

Token id ``b`` is byte ``b`` (0-255); then the special tokens of :data:`SPECIAL` (a BOS, and
ChatML's ``<|im_end|>``, which ends a turn and is the end-of-sequence token) and the tags of
:data:`TAGS` (Hermes' ``<tool_call>`` ... ``</tool_call>``: vLLM's ``hermes`` tool parser
reads them from the decoded text, so they are ordinary tokens that decoding keeps). The
chat template lists each tool by name and parameter names only, so that a prompt does not
depend on how a server serializes the tools' JSON schemas.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BOS = "<|begin_of_text|>"
EOS = "<|im_end|>"  # the end of an assistant turn ends generation
PAD = "<|pad|>"
IM_START = "<|im_start|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
# ids 256 upwards, in this order; the tool tags are not "special": they stay in decoded text
# (the hermes parser reads them), as they would in a model trained to emit them.
SPECIAL = (BOS, EOS, PAD, IM_START)
TAGS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
VOCAB_SIZE = 256 + len(SPECIAL) + len(TAGS)
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set ns.system = messages[0].content %}"
    "{%- endif %}"
    "{%- if tools %}"
    "{%- set ns.system = ns.system ~ ('\\n' if ns.system else '') ~ 'Tools:' %}"
    "{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}"
    "{%- set props = (f.parameters or {}).properties or {} %}"
    "{%- set ns.system = ns.system ~ ' ' ~ f.name ~ '(' ~ (props | list | join(', ')) ~ ')' %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- if ns.system %}"
    "{{- '<|im_start|>system\\n' ~ ns.system ~ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' ~ (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) %}"
    "{{- '<tool_call>{\"name\": \"' ~ fn.name ~ '\", \"arguments\": ' ~ args ~ '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' ~ message.content }}"
    "{{- '</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def build_tokenizer(directory: Path) -> Any:
    """Write the byte-level tokenizer with its chat template into ``directory`` and return
    it (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    # ByteLevel maps each byte to a printable character; id b is byte b.
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table

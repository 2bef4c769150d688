"""A tiny Llama checkpoint with a byte-level tokenizer and a tool-capable chat template,
built offline in seconds, for the capture proxy's tests against a real vLLM engine.

The weights are random (seeded): the tests that need a particular output (a valid or an
invalid tool call) force it through the engine's own structured outputs (``structured_outputs``
``choice``), so the proxy sees what vLLM really returns for such text, parsed by vLLM's hermes
tool parser. Its ``generation_config.json`` sets sampling defaults (temperature 0.8, top_p 0.95,
top_k 40) so the tests can see the proxy record the engine's defaults, not OpenAI's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

BOS, EOS = "<s>", "</s>"

# hermes format (vLLM's --tool-call-parser hermes): the model writes
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

GENERATION_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 40}


def build_tiny_llama(out: Path, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, generation config) to ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    out.mkdir(parents=True, exist_ok=True)
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    vocab[BOS], vocab[EOS] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=258, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=256, eos_token_id=257, tie_word_embeddings=False,
        torch_dtype="float32",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 256, "eos_token_id": 257, **GENERATION_DEFAULTS}, indent=1)
    )
    for path in out.iterdir():
        os.chmod(path, 0o644)
    return out

"""A tiny local model directory for running SGLang on the emulated GPU without any download.

:func:`write_tiny_model` writes a 2-layer ``LlamaForCausalLM`` ``config.json`` and a
byte-level BPE tokenizer trained on a fixed built-in text with the ``tokenizers`` package
(deterministic, no hub access), so SGLang's text endpoints (``/generate`` with ``text``,
``/v1/completions``, ``/v1/chat/completions``) work.  The emulated GPU ignores the model's
size: step times come from the hardware profile.

Usage: ``python -m sglang_ext.adapter.emulated_gpu.tiny_model <directory>``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["BOS_TOKEN", "EOS_TOKEN", "write_tiny_model"]

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
_SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN]
_TOKENIZER_VOCAB = 1000
_MODEL_VOCAB = 1024  # >= the tokenizer's vocabulary; a multiple of 64
_CONTEXT_LEN = 8192

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

_CORPUS = """\
Large language model serving systems batch many requests into every forward step.
A prefill step processes the prompt tokens of new requests, and a decode step produces
one new token for each running request. The scheduler decides which requests join the
next batch, how many prompt tokens each prefill chunk may take, and when a decode may
wait. Time to first token and time per output token are the latency targets that users
feel; throughput is what the operator pays for. The quick brown fox jumps over the lazy
dog. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000; punctuation , . ; : ! ? ' " ( ) [ ] { }.
"""


def write_tiny_model(directory: str | Path, context_len: int = _CONTEXT_LEN) -> Path:
    """Write ``config.json`` and tokenizer files into ``directory`` (created); return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    if tokenizer.get_vocab_size() > _MODEL_VOCAB:
        raise RuntimeError(f"tokenizer vocabulary {tokenizer.get_vocab_size()} > {_MODEL_VOCAB}")

    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": context_len,
            "chat_template": _CHAT_TEMPLATE,
        },
    )
    _write_json(path / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN})
    _write_json(
        path / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "max_position_embeddings": context_len,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "vocab_size": _MODEL_VOCAB,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "torch_dtype": "bfloat16",
        },
    )
    _write_json(path / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    return path


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m sglang_ext.adapter.emulated_gpu.tiny_model <directory>")
    print(write_tiny_model(sys.argv[1]))

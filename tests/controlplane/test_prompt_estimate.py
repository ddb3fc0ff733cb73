"""The daemon's prompt-token estimate, and how far it is from what a rank counts."""

from __future__ import annotations

import math

from controlplane.config import DaemonConfig
from controlplane.prompt_estimate import estimate_prompt_tokens
from controlplane.protocol import ChatMessage, Prompt
from sglang_ext.sim.rank import prompt_tokens


def test_token_ids_are_exact_and_text_is_bytes_over_chars_per_token():
    assert estimate_prompt_tokens(Prompt(token_ids=[1] * 37), 4.0, 5) == 37
    assert estimate_prompt_tokens(Prompt(text="a" * 10), 4.0, 5) == 3
    assert estimate_prompt_tokens(Prompt(text="é" * 4), 4.0, 5) == 2  # UTF-8 bytes, not characters


def test_a_conversation_counts_its_text_and_markup_per_turn_and_for_the_reply_header():
    conversation = Prompt(messages=[ChatMessage("system", "s" * 34), ChatMessage("user", "u" * 96)])
    text_bytes = 34 + 96
    assert estimate_prompt_tokens(conversation, 4.0, 5) == math.ceil(text_bytes / 4) + 5 * 3
    assert estimate_prompt_tokens(conversation, 4.0, 0) == math.ceil(text_bytes / 4)


def test_with_the_defaults_a_simulated_rank_counts_within_two_tokens_of_the_estimate():
    config = DaemonConfig()
    for turns in (1, 2, 8, 64):
        conversation = Prompt(messages=[ChatMessage("user" if i % 2 == 0 else "assistant", "word " * (i + 3))
                                        for i in range(turns)])
        estimate = estimate_prompt_tokens(conversation, config.chars_per_token, config.chat_tokens_per_message)
        assert 0 <= estimate - prompt_tokens(conversation) <= 2

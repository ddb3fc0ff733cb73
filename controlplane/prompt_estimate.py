"""The daemon's prompt-token estimate, made before any tokenizer has seen the prompt.

The daemon routes on it (a rank's admission budget is in prompt tokens) and does not
tokenize: the tokenizer and the chat template live at the ranks.

- token ids: their count, exact;
- text: ``ceil(utf8 bytes / chars_per_token)``;
- messages: each turn's content the same way, plus ``tokens_per_message`` for the
  template's markup around each turn (its role included: Llama 3's
  ``<|start_header_id|>user<|end_header_id|>\n\n ... <|eot_id|>`` is 5 tokens, ChatML's
  ``<|im_start|>user\n ... <|im_end|>\n`` 5) and for the assistant header it appends.

How far off a chat estimate may be: the text part errs as any text prompt does (the
tokenizer's real bytes per token against ``chars_per_token``); the markup part errs by
the model's real per-turn markup against ``tokens_per_message``, times the turns plus
one, plus whatever the template adds once (a BOS token, a default system prompt: Llama
3.1's adds about 25 tokens when the conversation has none). The rank counts the
rendered prompt exactly, and its own admission check uses that count.
"""

from __future__ import annotations

import math

from controlplane.protocol import Prompt


def estimate_prompt_tokens(prompt: Prompt, chars_per_token: float, tokens_per_message: int) -> int:
    if prompt.token_ids is not None:
        return len(prompt.token_ids)
    if prompt.messages is not None:
        text_bytes = sum(len(m.content.encode()) for m in prompt.messages)
        markup = tokens_per_message * (len(prompt.messages) + 1)
        return math.ceil(text_bytes / chars_per_token) + markup
    return math.ceil(len((prompt.text or "").encode()) / chars_per_token)

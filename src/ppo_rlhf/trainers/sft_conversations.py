"""SFT on whole conversations (docs/agents.md, "Warming up with SFT").

A conversation is one row: the chat template renders it whole -- tool calls as the template
writes a call, the tools it lists, the tools' answers -- as TRL's SFTTrainer renders it, and the
loss covers the tokens of each trained assistant turn, from the end of the generation prompt before
it (``<|im_start|>assistant\\n``) to the end of the turn as the template closes it (``<|im_end|>``),
less the whitespace the template writes after that (``\\n``: the model never writes it; an episode
appends it as the environment's).  Every assistant turn of a conversation trains in one row: one
row per turn repeated the conversation before each turn, about turns x its length in tokens.

A turn's place is read off the template itself: the conversation rendered up to the turn with the
generation prompt, and up to its end.  That needs a template that writes earlier turns the same
whatever follows them -- what an episode needs too (envs/chat.py) -- and a conversation whose
template drops them is refused by its row: Qwen3's, which writes a turn's think block only while
the turn is last, is read with ppo-rlhf's training template (every turn with its think block), as
PPO's episodes and TRL do.
"""

from __future__ import annotations

from ppo_rlhf.data import DataError
from ppo_rlhf.envs.chat import QWEN3_MARKERS, qwen3_training_template_path, template_text
from ppo_rlhf.envs.options import tool_template_path
from ppo_rlhf.formats import Conversation


def training_template(tokenizer) -> str | None:
    """The template conversations render with where it is not the tokenizer's own: ppo-rlhf's
    Qwen3 training template for Qwen3's (None: the tokenizer's)."""
    template = template_text(tokenizer) or ""
    if all(marker in template for marker in QWEN3_MARKERS):
        return qwen3_training_template_path().read_text()
    return None


def assistant_spans(tokenizer, conversation: Conversation, where: str, template: str | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation rendered whole, (start, end) of each trained assistant turn's characters
    in it); DataError naming ``where`` (the row) for a template that renders a turn differently once
    messages follow it, or leaves out its tool calls."""
    messages = conversation.messages

    def render(upto: int, opened: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=conversation.tools, tokenize=False,
                                             add_generation_prompt=opened,
                                             **({"chat_template": template} if template else {}))

    try:
        whole, spans = render(len(messages), False), []
        for i, message in enumerate(messages):
            if i < conversation.trained_from or message["role"] != "assistant":
                continue
            before, after = render(i, True), render(i + 1, False)
            if not (after.startswith(before) and whole.startswith(after)):
                raise DataError(f"{where}: the chat template writes assistant message {i} differently once the "
                                f"generation prompt is added or more messages follow it, so its tokens cannot be "
                                f"told from the conversation's; give a template that writes earlier turns the same "
                                f"whatever follows them with --chat-template-file (ppo-rlhf ships one for ChatML "
                                f"models: {tool_template_path()})")
            for call in message.get("tool_calls") or []:
                if call["function"]["name"] not in after[len(before):]:
                    raise DataError(f"{where}: the chat template leaves out assistant message {i}'s tool call "
                                    f"({call['function']['name']}), so the model would learn a turn without it; "
                                    f"give a template that writes tool calls with --chat-template-file (ppo-rlhf "
                                    f"ships one for ChatML models such as SmolLM2: {tool_template_path()})")
            spans.append((len(before), len(after)))
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 -- a template that raises on the row's messages (jinja's own errors)
        raise DataError(f"{where}: the chat template raises on this conversation ({type(error).__name__}: "
                        f"{error})") from None
    return whole, spans


def token_offsets(tokenizer, text: str, cuts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """``text``'s token ids and each one's (start, end) characters: a fast tokenizer's offsets, or
    (a slow one) the text tokenized piece by piece between ``cuts``, each piece's tokens given its
    characters."""
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], [tuple(span) for span in encoded["offset_mapping"]]
    ids, offsets = [], []
    bounds = sorted({0, len(text), *cuts})
    for start, end in zip(bounds, bounds[1:]):
        piece = tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        ids += piece
        offsets += [(start, end)] * len(piece)
    return ids, offsets


def conversation_tokens(tokenizer, conversation: Conversation, where: str, template: str | None = None
                        ) -> tuple[list[int], list[int]]:
    """(token ids, labels) of a conversation: labels -100 but on the trained assistant turns' tokens
    (a token that overlaps a turn's characters counts, as transformers' assistant masks count it),
    each turn less the whitespace-only tokens that end it (the template's newline after its end of
    turn)."""
    whole, spans = assistant_spans(tokenizer, conversation, where, template)
    ids, offsets = token_offsets(tokenizer, whole, [edge for span in spans for edge in span])
    labels = [-100] * len(ids)
    for start, end in spans:
        inside = [t for t, (first, last) in enumerate(offsets) if last > start and first < end]
        while inside and not tokenizer.decode([ids[inside[-1]]]).strip():
            inside.pop()
        for t in inside:
            labels[t] = ids[t]
    return ids, labels

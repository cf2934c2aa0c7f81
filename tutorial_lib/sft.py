"""Supervised fine-tuning (SFT) on chats: learn the assistant's replies, not the user's words.

A chat model is trained on conversations laid out by its chat template. The loss is the
usual next-token cross-entropy, but counted only where the *assistant* speaks: the model
should learn to answer, not to write the system prompt or imitate the user. Each example is
a pair of aligned lists:

    ids     <|im_start|>system ... <|im_end|> \\n <|im_start|>user \\n Write ... <|im_end|> \\n
            <|im_start|>assistant \\n 2 0 2 1 - 0 3 - 0 3 <|im_end|> \\n
    labels  -100 ...                                           -100  2 0 2 1 - 0 3 - 0 3 <|im_end|> -100

``labels[t]`` is ``ids[t]`` where the token counts and -100 (:data:`IGNORE`, PyTorch's
``ignore_index``) elsewhere. Labels are aligned with the ids, not shifted: the shift, logits
at position t predicting token t + 1, happens in one place, :func:`token_log_probs`.

**Which tokens count.** The assistant's content and its end-of-turn token ``<|im_end|>``,
so that the model learns to stop. SmolLM2's template writes a newline after every
``<|im_end|>``; that newline is *not* counted: generation ends at ``<|im_end|>``
(``stop_ids``), so the model never has to produce it, and in a longer conversation it
belongs to the layout between turns. The turn's opening ``<|im_start|>assistant\\n`` is not
counted either: the prompt supplies it (``add_generation_prompt=True``).

**Finding those tokens.** The template is rendered twice: the conversation up to an
assistant message with ``add_generation_prompt=True`` (the prompt a model would be given),
and with the message. If the first is a prefix of the second, token for token, the reply's
tokens are what follows, up to and including the first end-of-turn id (a ``<|im_end|>``
typed in a message is text, never that id). A template for which the prefix property fails
is refused with a ValueError rather than guessed at.

:func:`chat_example` with ``assistant_only=False`` counts every token: the model then also
spends its training on the system prompt and the user's questions (notebook 12 shows what
that costs).

The task is the date normalisation of notebook 05 (:mod:`tutorial_lib.dates`) asked as a
chat: user "Write this date as YYYY-MM-DD: 3rd of March 2021", assistant "2021-03-03". Train
and held-out examples come from the task's disjoint date sets, so no held-out question is
ever trained on.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .checks import check_count, check_int
from .dates import FORMAT_NAMES, FORMATS, HELD_OUT_DATES, TRAIN_DATES, DateExample, exact_match, make_example
from .sampling import generate

IGNORE = -100  # label of a token that the loss skips (F.cross_entropy's default ignore_index)
INSTRUCTION = "Write this date as YYYY-MM-DD: "
SPLITS = {"train": TRAIN_DATES, "held_out": HELD_OUT_DATES}


# ---- the data: date questions as chats --------------------------------------------------------


def date_examples(n: int, *, split: str = "train", seed: int = 0,
                  formats: Sequence[str] = FORMAT_NAMES) -> list[DateExample]:
    """``n`` distinct (date, format) examples of ``split`` ("train" or "held_out"), the same
    list for the same seed on every machine. The two splits use the disjoint date sets of
    :mod:`tutorial_lib.dates`, so they share no question (and no date)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    check_int("seed", seed)
    formats = tuple(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if not formats or unknown:
        raise ValueError(f"formats must be names from {list(FORMATS)}, got {list(formats)!r}")
    dates = SPLITS[split]
    check_count("n", n, maximum=len(dates) * len(formats), bound_name="dates x formats")
    picks = random.Random(f"{split}/{seed}").sample(range(len(dates) * len(formats)), n)  # without repeats
    return [make_example(dates[i // len(formats)], formats[i % len(formats)]) for i in picks]


def date_messages(example: DateExample, *, answer: bool = True) -> list[dict[str, str]]:
    """The question as a chat (a user message), with the expected answer as the assistant's
    reply unless ``answer=False`` (a prompt to generate from)."""
    messages = [{"role": "user", "content": INSTRUCTION + example.source}]
    return messages + ([{"role": "assistant", "content": example.target}] if answer else [])


# ---- one conversation -> ids and labels ---------------------------------------------------------


class ChatExample(NamedTuple):
    ids: list[int]  # the conversation laid out by the chat template
    labels: list[int]  # ids[t] where the loss counts token t, IGNORE elsewhere (aligned, not shifted)


def _end_of_turn(tokenizer, end_id: int | None) -> int:
    end_id = getattr(tokenizer, "eos_id", None) if end_id is None else end_id
    if end_id is None:
        raise ValueError("the tokenizer has no eos_id (the end of a turn, <|im_end|> for SmolLM2); pass end_id")
    return check_int("end_id", end_id, why="the id that ends a turn")


def assistant_spans(tokenizer, messages: Sequence[Mapping[str, str]], *,
                    end_id: int | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids of the whole conversation, [(start, end)) token positions of each assistant reply,
    its end-of-turn token included). ``end_id``: the end of a turn (default the tokenizer's
    ``eos_id``). Raises ValueError when the template's prompt for a reply is not a prefix of
    the conversation, or a reply's tokens do not decode to its content."""
    end_id = _end_of_turn(tokenizer, end_id)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if k == 0:
            raise ValueError("message 0 is the assistant's: a reply needs a message before it")
        prompt = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True)
        if ids[:len(prompt)] != prompt:
            raise ValueError(f"the chat template's prompt for message {k} (add_generation_prompt=True) is not a "
                             "prefix of the conversation's tokens, so the reply's tokens cannot be told apart")
        start = len(prompt)
        try:
            end = ids.index(end_id, start) + 1  # through the end-of-turn token
        except ValueError:
            raise ValueError(f"message {k}: no end-of-turn id {end_id} after the reply") from None
        if tokenizer.decode(ids[start:end - 1]) != message["content"]:
            raise ValueError(f"message {k}: the tokens after the prompt decode to "
                             f"{tokenizer.decode(ids[start:end - 1])!r}, not the reply {message['content']!r}")
        spans.append((start, end))
    return ids, spans


def chat_example(tokenizer, messages: Sequence[Mapping[str, str]], *, assistant_only: bool = True,
                 end_id: int | None = None) -> ChatExample:
    """The ids of a conversation and its labels: the assistant's tokens (content and
    end-of-turn) where ``assistant_only``, every token otherwise."""
    if not isinstance(assistant_only, bool):
        raise ValueError(f"assistant_only must be True or False, got {assistant_only!r}")
    ids, spans = assistant_spans(tokenizer, messages, end_id=end_id)
    if not assistant_only:
        return ChatExample(ids, list(ids))
    if not spans:
        raise ValueError("the conversation has no assistant message: with assistant_only=True no token would count")
    labels = [IGNORE] * len(ids)
    for start, end in spans:
        labels[start:end] = ids[start:end]
    return ChatExample(ids, labels)


# ---- batches and the masked loss -----------------------------------------------------------------


class ChatBatch(NamedTuple):
    ids: Tensor  # (B, T) padded at the end with pad_id
    labels: Tensor  # (B, T) IGNORE at padding

    def to(self, device) -> ChatBatch:
        return ChatBatch(self.ids.to(device), self.labels.to(device))


def collate(examples: Sequence[ChatExample], *, pad_id: int = 0, device=None) -> ChatBatch:
    """Pad examples at the end to one length: ids with ``pad_id``, labels with IGNORE.

    Padding at the end needs no attention mask: under the causal mask a real token never
    sees a later position, so the pads change nothing before them, and their labels don't
    count. Any id will do as ``pad_id``."""
    if isinstance(examples, ChatExample) or not examples:
        raise ValueError("collate needs a non-empty list of ChatExamples")
    check_count("pad_id", pad_id, 0, why="a token id")
    T = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for b, e in enumerate(examples):
        if len(e.ids) != len(e.labels):
            raise ValueError(f"example {b} has {len(e.ids)} ids and {len(e.labels)} labels")
        ids[b, :len(e.ids)] = torch.tensor(e.ids)
        labels[b, :len(e.labels)] = torch.tensor(e.labels)
    return ChatBatch(ids, labels).to(device)


def token_log_probs(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(log p of each counted next token (B, T - 1), 0 where not counted; the mask of counted
    positions (B, T - 1)). logits: (B, T, V), position t predicting token t + 1; labels: (B, T)
    aligned with the ids."""
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got {getattr(logits, 'shape', type(logits).__name__)}")
    if not isinstance(labels, Tensor) or labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must be (B, T) = {tuple(logits.shape[:2])}, the logits' first two axes, "
                         f"got {getattr(labels, 'shape', type(labels).__name__)}")
    # the target of position t is token t + 1; the last position has none. Padding the targets
    # (rather than slicing the logits) keeps the (B, T, V) logits contiguous for log_softmax.
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)  # (B, T)
    keep = targets != IGNORE
    log_probs = logits.float().log_softmax(dim=-1)  # (B, T, V)
    log_p = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T): the right token's
    return log_p.masked_fill(~keep, 0.0)[:, :-1], keep[:, :-1]


def masked_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over the counted tokens of the batch (every counted token weighs the
    same, however the rows are padded): F.cross_entropy with ignore_index=-100, written out."""
    log_p, keep = token_log_probs(logits, labels)
    n = keep.sum()
    if not bool(n):
        raise ValueError("no label counts (all are IGNORE): the mean over no tokens is 0 / 0")
    return -log_p.sum() / n


def answer_log_probs(logits: Tensor, labels: Tensor) -> Tensor:
    """(B,) the log-probability of each row's counted tokens: the sum of their log p."""
    return token_log_probs(logits, labels)[0].sum(dim=1)


def sft_loss(model: nn.Module, batch: ChatBatch) -> Tensor:
    """The masked loss of one forward pass of ``model`` over a :class:`ChatBatch`."""
    return masked_loss(model(batch.ids).logits, batch.labels)


# ---- evaluation: greedy answers, exact match -----------------------------------------------------


@torch.no_grad()
def generate_replies(model: nn.Module, tokenizer, prompts: Sequence[Sequence[Mapping[str, str]]], *,
                     max_new_tokens: int = 16, batch_size: int = 64, end_id: int | None = None) -> list[str]:
    """The model's greedy reply to each prompt (a list of messages), cut at the end of turn.

    generate takes no padding mask, so prompts are batched with others of the same token
    length (the date questions come in a few dozen lengths); every row stops at its own
    ``<|im_end|>``. The same replies as one prompt at a time."""
    end_id = _end_of_turn(tokenizer, end_id)
    check_count("batch_size", batch_size)
    encoded = [tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    device = next(model.parameters()).device
    replies: list[str | None] = [None] * len(encoded)
    for length, rows in by_length.items():
        for at in range(0, len(rows), batch_size):
            chunk = rows[at:at + batch_size]
            ids = torch.tensor([encoded[i] for i in chunk], device=device)  # (b, length)
            out = generate(model, ids, max_new_tokens, stop_ids=[end_id])[:, length:].tolist()
            for i, new in zip(chunk, out):
                replies[i] = tokenizer.decode(new[:new.index(end_id)] if end_id in new else new)
    return replies


def date_answers(model: nn.Module, tokenizer, examples: Sequence[DateExample], **options) -> list[str]:
    """The model's greedy answer to each date question (options: see :func:`generate_replies`)."""
    return generate_replies(model, tokenizer, [date_messages(e, answer=False) for e in examples], **options)


def date_accuracy(model: nn.Module, tokenizer, examples: Sequence[DateExample], **options) -> float:
    """Exact match: the fraction of questions answered with exactly the ISO date, no more."""
    return exact_match(date_answers(model, tokenizer, examples, **options), [e.target for e in examples])

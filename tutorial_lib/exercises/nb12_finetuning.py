"""Exercises of notebook 12 (from a language model to an assistant): the assistant-only loss
mask, the LoRA forward pass, and the DPO loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import Exercise, Mistake

IGNORE = -100  # the label the loss skips (F.cross_entropy's ignore_index)

# ---- 12.loss_mask: labels that count the answer and its end-of-turn token only ------------------------


def loss_mask(ids, prompt_length, end_id):
    """ids (T,) int64 a whole conversation, prompt_length the number of tokens of the prompt (up to
    and including the opening of the assistant's turn), end_id the end-of-turn id -> labels (T,)
    int64: ids[t] from prompt_length through the first end_id at or after it, -100 elsewhere."""
    labels = torch.full_like(ids, IGNORE)
    end = prompt_length + int((ids[prompt_length:] == end_id).nonzero()[0]) + 1  # through the end token
    labels[prompt_length:end] = ids[prompt_length:end]
    return labels


def _mask_cases():
    # laid out as a chat template does: <s>=1 role words ... <e>=2 newline=198, turn after turn; the
    # end id closes the system and user turns too, and the template writes a newline after the reply
    g = torch.Generator().manual_seed(12)

    def words(n):  # ordinary token ids, never the special ones
        return torch.randint(10, 500, (n,), generator=g).tolist()

    cases = []
    for n_system, n_user, n_answer, n_after in ((4, 6, 3, 1), (0, 9, 5, 2), (7, 3, 1, 3), (5, 5, 10, 4)):
        system = [1, 9] + words(n_system) + [2, 198] if n_system else []
        prompt = system + [1, 7] + words(n_user) + [2, 198, 1, 8, 198]  # ... <s> assistant \n
        after = ([198] + [1, 7, 11, 2][:n_after - 1]) if n_after else []  # the newline, maybe a next turn
        ids = torch.tensor(prompt + words(n_answer) + [2] + after)
        cases.append((ids, len(prompt), 2))
    return cases


def _mask_with_prompt(ids, prompt_length, end_id):
    labels = torch.full_like(ids, IGNORE)
    end = prompt_length + int((ids[prompt_length:] == end_id).nonzero()[0]) + 1
    labels[:end] = ids[:end]  # the system and user turns count too
    return labels


def _mask_without_end(ids, prompt_length, end_id):
    labels = torch.full_like(ids, IGNORE)
    end = prompt_length + int((ids[prompt_length:] == end_id).nonzero()[0])
    labels[prompt_length:end] = ids[prompt_length:end]
    return labels


def _mask_shifted(ids, prompt_length, end_id):
    labels = torch.full_like(ids, IGNORE)
    end = prompt_length + int((ids[prompt_length:] == end_id).nonzero()[0]) + 1
    labels[prompt_length - 1:end - 1] = ids[prompt_length:end]  # the next token at each position
    return labels


def _mask_to_the_end(ids, prompt_length, end_id):
    labels = torch.full_like(ids, IGNORE)
    labels[prompt_length:] = ids[prompt_length:]  # the newline after the end token counts too
    return labels


# ---- 12.lora_forward: W x + (alpha / r) B A x ------------------------------------------------------------


def lora_forward(x, W, A, B, alpha, r):
    """x (N, d_in), W (d_out, d_in), A (r, d_in), B (d_out, r) -> (N, d_out): x W^T + (alpha / r) x A^T B^T,
    the frozen layer plus the low-rank update, on a batch of row vectors."""
    return x @ W.T + (alpha / r) * ((x @ A.T) @ B.T)


def _lora_cases():
    # square layers (an attention output projection) of a few ranks; B nonzero, as after training
    g = torch.Generator().manual_seed(13)
    cases = []
    for n, d, r, alpha in ((3, 8, 2, 4.0), (5, 12, 4, 16.0), (2, 6, 1, 8.0), (4, 10, 5, 5.0)):
        cases.append((torch.randn(n, d, generator=g), torch.randn(d, d, generator=g),
                      torch.randn(r, d, generator=g), torch.randn(d, r, generator=g), alpha, r))
    return cases


def _lora_no_scale(x, W, A, B, alpha, r):
    return x @ W.T + (x @ A.T) @ B.T


def _lora_alpha(x, W, A, B, alpha, r):
    return x @ W.T + alpha * ((x @ A.T) @ B.T)


def _lora_b_first(x, W, A, B, alpha, r):
    return x @ W.T + (alpha / r) * ((x @ B) @ A)  # x B A: the update (B A)^T's transpose


# ---- 12.dpo_loss: -log sigmoid(beta h) ---------------------------------------------------------------------


def dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta):
    """Four (B,) log-probabilities (of the chosen and the rejected answer under the policy and the
    frozen reference) and beta -> the mean over the pairs of -log sigmoid(beta h), with
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)."""
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -F.logsigmoid(beta * h).mean()


def _dpo_cases():
    g = torch.Generator().manual_seed(14)
    cases = []
    for B, beta in ((4, 0.1), (6, 0.5), (3, 2.0)):
        ref_c, ref_r = -torch.rand(B, generator=g) * 20, -torch.rand(B, generator=g) * 20
        cases.append((ref_c + torch.randn(B, generator=g) * 3, ref_r + torch.randn(B, generator=g) * 3,
                      ref_c, ref_r, beta))
    # the reference ranks these pairs the other way than the policy: forgetting it changes the sign of h
    cases.append((torch.tensor([-3.0, -2.0]), torch.tensor([-4.0, -6.0]), torch.tensor([-1.0, -0.5]),
                  torch.tensor([-9.0, -12.0]), 0.3))
    # a pair ranked very wrongly: beta h = -150, where sigmoid underflows float32 and log(sigmoid) is -inf
    cases.append((torch.tensor([-300.0, -5.0]), torch.tensor([-2.0, -6.0]), torch.tensor([-4.0, -5.0]),
                  torch.tensor([-6.0, -6.0]), 0.5))
    return cases


def _dpo_no_beta(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta):
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -F.logsigmoid(h).mean()


def _dpo_no_reference(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta):
    return -F.logsigmoid(beta * (policy_chosen - policy_rejected)).mean()


def _dpo_sign(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta):
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -F.logsigmoid(-beta * h).mean()


def _dpo_log_of_sigmoid(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta):
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -torch.log(torch.sigmoid(beta * h)).mean()


EXERCISES = [
    Exercise(
        name="12.loss_mask",
        task="loss_mask(ids, prompt_length, end_id): ids (T,) int64 is a conversation laid out by the chat "
             "template, whose first prompt_length tokens are the prompt (through the opening of the assistant's "
             "turn). Return labels (T,) int64: ids[t] from position prompt_length through the first end_id at or "
             "after it (the answer and its end-of-turn token), -100 everywhere else. Labels stay aligned with "
             "the ids: the loss does the shift.",
        cases=_mask_cases,
        reference=loss_mask,
        forbidden=("chat_example", "assistant_spans"),
        mistakes={
            "counted the prompt": Mistake(
                _mask_with_prompt, "The system and user turns are given, not written by the model: label them "
                                   "-100, or the model is also trained to write the user's questions."),
            "left out the end-of-turn token": Mistake(
                _mask_without_end, "The end id must count too: it is how the model learns to stop after the "
                                   "answer."),
            "shifted the labels by one": Mistake(
                _mask_shifted, "Keep labels[t] = ids[t]: the loss pairs the logits at t with the label at t + 1 "
                               "itself, so a shifted label is shifted twice."),
            "counted everything after the prompt": Mistake(
                _mask_to_the_end, "Stop at the first end id: what the template writes after it (a newline, a "
                                  "next turn) is not the model's answer."),
        },
    ),
    Exercise(
        name="12.lora_forward",
        task="lora_forward(x, W, A, B, alpha, r): x (N, d_in) is a batch of row vectors, W (d_out, d_in) the frozen "
             "weight, A (r, d_in) and B (d_out, r) the adapter. Return (N, d_out): W x + (alpha / r) B A x for "
             "every row, i.e. x W^T + (alpha / r) (x A^T) B^T.",
        cases=_lora_cases,
        reference=lora_forward,
        forbidden=("LoRALinear", "add_lora", "delta_weight"),
        mistakes={
            "forgot the scale": Mistake(
                _lora_no_scale, "The update is multiplied by alpha / r."),
            "scaled by alpha instead of alpha / r": Mistake(
                _lora_alpha, "Divide by the rank: alpha / r keeps the size of the first steps the same "
                             "whatever r is."),
            "applied B before A": Mistake(
                _lora_b_first, "A (r, d_in) reads the input first and B (d_out, r) writes the output: for row "
                               "vectors x A^T, then B^T."),
        },
    ),
    Exercise(
        name="12.dpo_loss",
        task="dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta): four (B,) "
             "tensors of sequence log-probabilities and a float beta. Return the scalar mean over the pairs of "
             "-log sigmoid(beta * h), h = (policy_chosen - reference_chosen) - (policy_rejected - "
             "reference_rejected); it must stay finite where sigmoid underflows.",
        cases=_dpo_cases,
        reference=dpo_loss,
        forbidden=("dpo_loss", "dpo_batch_loss"),
        mistakes={
            "left out beta": Mistake(
                _dpo_no_beta, "Multiply the margin by beta before the sigmoid: beta sets how far the policy "
                              "may move from the reference."),
            "forgot the reference": Mistake(
                _dpo_no_reference, "h compares log-ratios: how much the policy raised each answer relative to "
                                   "the reference, not the policy's log-probabilities alone."),
            "flipped the sign": Mistake(
                _dpo_sign, "The loss must fall as the chosen answer gains on the rejected one: "
                           "-log sigmoid(+beta h)."),
            "took the log of the sigmoid": Mistake(
                _dpo_log_of_sigmoid, "sigmoid(-150) is 0 in float32 and its log -inf: use F.logsigmoid, or "
                                     "-softplus(-z), which stays finite."),
        },
    ),
]

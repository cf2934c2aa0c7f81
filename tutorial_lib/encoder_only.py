"""Encoder-only models (BERT-like): a backbone that turns tokens, or continuous feature frames,
into one vector per position, and the heads that sit on it.

- :class:`EncoderBackbone`: token embeddings (or a linear frontend for feature frames, as in
  speech models) + positions + :class:`~tutorial_lib.transformer.Encoder`, with a padding mask
  built from per-example lengths (or from ``pad_id``).
- Masked language modelling (Devlin et al., 2019, section 3.1): :func:`mask_tokens` selects
  15 % of the positions that are not special tokens and replaces 80 % of those by [MASK], 10 % by
  a random token and keeps 10 %; :class:`MaskedLM` predicts the original token, with the loss at
  the selected positions only.
- :class:`SequenceClassifier`: one label per sequence, read from the [CLS] position or from the
  mean over the real (non-padding) positions (:func:`mean_pool`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import IdRange, check_count, check_id_tensor, check_id_values, check_number
from .config import ModelConfig
from .layers import Embeddings, init_weights
from .transformer import Encoder

IGNORE_INDEX = -100  # the label of positions the loss must skip (F.cross_entropy's default)


class EncoderOnlyOutput(NamedTuple):
    logits: Tensor  # (B, T, V) for MaskedLM, (B, n_classes) for SequenceClassifier
    loss: Tensor | None  # None unless labels were given
    attn: Tensor | None  # (L, B, h, T, S) when need_weights=True


class Encoded(NamedTuple):
    x: Tensor  # (B, T, d): one vector per position (padding positions hold values no one should read)
    keep: Tensor  # (B, T) bool: True at real positions, False at padding
    weights: Tensor | None  # (L, B, h, T, S) when asked for


def keep_from_lengths(lengths: Tensor, T: int) -> Tensor:
    """(B,) lengths -> (B, T) keep flags, True at the first ``lengths[b]`` positions."""
    if not isinstance(lengths, Tensor) or lengths.dim() != 1 or lengths.dtype.is_floating_point \
            or lengths.dtype == torch.bool:
        got = f"{lengths.dtype} {tuple(lengths.shape)}" if isinstance(lengths, Tensor) else type(lengths).__name__
        raise ValueError(f"lengths must be an integer tensor of shape (B,), got {got}")
    if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > T):
        raise ValueError(f"lengths must lie in [1, T={T}] (every example needs a real position), "
                         f"got {lengths.tolist()}")
    return torch.arange(T, device=lengths.device) < lengths[:, None]  # (B, T)


class EncoderBackbone(nn.Module):
    """Inputs -> one d-vector per position, with padding masked out of attention.

    Token inputs: ids (B, T). With ``n_features`` the input is instead continuous frames
    (B, T, n_features), projected to d_model by a linear frontend; positions are added to its
    output just as to token embeddings. Padding comes from ``lengths`` (B,) (right padding),
    or, for tokens, from ``pad_id`` when no lengths are given.
    """

    def __init__(self, cfg: ModelConfig, *, n_features: int | None = None, pad_id: int | None = None):
        super().__init__()
        if cfg.family != "encoder":
            raise ValueError(f"an encoder-only model needs family='encoder', got {cfg.family!r}")
        check_count("n_features", n_features, optional=True)
        if n_features is not None and pad_id is not None:
            raise ValueError("pad_id marks padding among token ids; feature frames take lengths instead")
        if pad_id is not None and not 0 <= pad_id < cfg.vocab_size:
            raise ValueError(f"pad_id must lie in [0, vocab_size={cfg.vocab_size}), got {pad_id}")
        self.cfg = cfg
        self.n_features = n_features
        self.pad_id = pad_id
        self.frontend = nn.Linear(n_features, cfg.d_model) if n_features is not None else None
        self.embed = Embeddings(cfg, 0 if n_features is not None else cfg.vocab_size)
        self.encoder = Encoder(cfg)

    def _check_inputs(self, inputs: Tensor, check_ids: bool) -> None:
        """Token ids (shape, dtype, then their values: one host sync) or feature frames (shape,
        dtype). ``check_ids=False`` leaves out the checks of token ids. (:meth:`keep` checks
        the lengths, which it reads anyway.)"""
        if self.frontend is None:
            if check_ids:
                check_id_values(IdRange("ids", check_id_tensor("ids", inputs), self.cfg.vocab_size))
        elif not isinstance(inputs, Tensor) or inputs.dim() != 3 or inputs.size(-1) != self.n_features \
                or not inputs.is_floating_point():
            got = f"{inputs.dtype} {tuple(inputs.shape)}" if isinstance(inputs, Tensor) else type(inputs).__name__
            raise ValueError(f"expected float feature frames (B, T, n_features={self.n_features}), got {got}")

    def keep(self, inputs: Tensor, lengths: Tensor | None = None) -> Tensor:
        """(B, T) keep flags for these inputs: from lengths, else from pad_id, else all True."""
        B, T = inputs.shape[:2]
        if lengths is not None:
            if lengths.shape != (B,):
                raise ValueError(f"lengths must have shape (B={B},), got {tuple(lengths.shape)}")
            return keep_from_lengths(lengths.to(inputs.device), T)
        if self.pad_id is not None:
            keep = inputs != self.pad_id
            if not keep.any(dim=1).all():
                raise ValueError("an example holds nothing but padding")
            return keep
        return torch.ones(B, T, dtype=torch.bool, device=inputs.device)

    def forward(self, inputs: Tensor, *, lengths: Tensor | None = None, need_weights: bool = False,
                check_ids: bool = True) -> Encoded:
        """``check_ids=False``: the caller has already checked the token ids (shape, dtype, range)."""
        self._check_inputs(inputs, check_ids)
        if self.frontend is None:
            x = self.embed(inputs, check_ids=False)  # (B, T, d): the ids are checked above
        else:
            x = self.embed.add_positions(self.frontend(inputs))  # (B, T, d)
        keep = self.keep(inputs, lengths)  # (B, T)
        out = self.encoder(x, keep[:, None, None, :], need_weights=need_weights)  # mask (B, 1, 1, S)
        return Encoded(out.x, keep, out.weights)


# ---- masked language modelling ------------------------------------------------------------------


class MLMBatch(NamedTuple):
    inputs: Tensor  # (B, T) ids after corruption
    labels: Tensor  # (B, T) the original id at selected positions, IGNORE_INDEX elsewhere
    selected: Tensor  # (B, T) bool: positions the loss looks at


def mask_tokens(ids: Tensor, *, mask_id: int, vocab_size: int, special_ids: Iterable[int] = (),
                select_prob: float = 0.15, mask_prob: float = 0.8, random_prob: float = 0.1,
                generator: torch.Generator | None = None) -> MLMBatch:
    """BERT's corruption for masked language modelling.

    Each position whose id is not special (``special_ids`` and ``mask_id``; padding belongs in
    ``special_ids``) is selected independently with probability ``select_prob``. A selected
    position becomes ``mask_id`` with probability ``mask_prob``, a random non-special id with
    probability ``random_prob`` (which may by chance be the original id, as in BERT), and is
    left unchanged otherwise. Unselected positions are never changed and get the label
    ``IGNORE_INDEX``. Random draws come from ``generator`` (on the CPU) for repeatable batches.
    """
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"ids must be an integer tensor of shape (B, T), got {got}")
    for name, p in (("select_prob", select_prob), ("mask_prob", mask_prob), ("random_prob", random_prob)):
        check_number(name, p, low=0.0, high=1.0)
    if mask_prob + random_prob > 1.0:
        raise ValueError(f"mask_prob + random_prob must be at most 1, got {mask_prob} + {random_prob}")
    check_count("vocab_size", vocab_size)
    special_ids = list(special_ids)
    for name, value in [("mask_id", mask_id)] + [(f"special_ids[{i}]", v) for i, v in enumerate(special_ids)]:
        if isinstance(value, bool) or not hasattr(value, "__index__"):  # an int, or an int tensor of one value
            raise ValueError(f"{name} must be an int token id, got {value!r}")
    specials = sorted({int(i) for i in special_ids} | {int(mask_id)})
    if any(not 0 <= i < vocab_size for i in specials):
        raise ValueError(f"mask_id and special_ids must lie in [0, vocab_size={vocab_size}), got {specials}")
    ordinary = torch.tensor([i for i in range(vocab_size) if i not in set(specials)], dtype=torch.long)
    if len(ordinary) == 0:
        raise ValueError("every id is special: there is no token to select or to draw at random")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}")

    shape, device = ids.shape, ids.device
    eligible = ~torch.isin(ids, torch.tensor(specials, device=device))  # (B, T)
    select_u = torch.rand(shape, generator=generator).to(device)
    action_u = torch.rand(shape, generator=generator).to(device)  # which of mask / random / keep
    random_ids = ordinary[torch.randint(len(ordinary), shape, generator=generator)].to(device)

    selected = eligible & (select_u < select_prob)
    to_mask = selected & (action_u < mask_prob)
    to_random = selected & (action_u >= mask_prob) & (action_u < mask_prob + random_prob)
    inputs = torch.where(to_mask, torch.full_like(ids, mask_id), ids)
    inputs = torch.where(to_random, random_ids.to(ids.dtype), inputs)
    labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
    return MLMBatch(inputs, labels, selected)


class MLMHead(nn.Module):
    """BERT's prediction head: dense + GELU + LayerNorm, then a projection to the vocabulary
    (plus a bias). :class:`MaskedLM` ties the projection to the token table when the config
    asks for tied embeddings."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d) -> (B, T, V)
        return self.decoder(self.norm(F.gelu(self.dense(x))))


class MaskedLM(nn.Module):
    """An encoder-only model with an MLM head: predicts a token at every position.

    With labels from :func:`mask_tokens` the loss is the mean cross-entropy over the selected
    positions only; with a label at every position it is a token tagger.
    """

    def __init__(self, cfg: ModelConfig, *, pad_id: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.backbone = EncoderBackbone(cfg, pad_id=pad_id)
        self.head = MLMHead(cfg)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.head.decoder.weight = self.backbone.embed.tokens.weight  # one matrix in and out

    def _check_inputs(self, ids: Tensor, labels: Tensor | None) -> None:
        """Shapes and dtypes of ids and labels, then their values in one host sync."""
        check_id_tensor("ids", ids)
        ranges = [IdRange("ids", ids, self.cfg.vocab_size)]
        if labels is not None:
            check_id_tensor("labels", labels, what="target ids")
            if labels.shape != ids.shape:
                raise ValueError(f"labels must have the shape of ids {tuple(ids.shape)}, got {tuple(labels.shape)}")
            ranges.append(IdRange("labels", labels, self.cfg.vocab_size, IGNORE_INDEX))
        check_id_values(*ranges)  # one host sync for ids and labels

    def forward(self, ids: Tensor, labels: Tensor | None = None, *, lengths: Tensor | None = None,
                need_weights: bool = False) -> EncoderOnlyOutput:
        """ids: (B, T); labels: (B, T), IGNORE_INDEX where there is nothing to predict."""
        self._check_inputs(ids, labels)
        encoded = self.backbone(ids, lengths=lengths, need_weights=need_weights, check_ids=False)
        logits = self.head(encoded.x)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        return EncoderOnlyOutput(logits, loss, encoded.weights)


# ---- sequence classification -------------------------------------------------------------------


def mean_pool(x: Tensor, keep: Tensor) -> Tensor:
    """Mean of x (B, T, d) over the positions where keep (B, T) is True -> (B, d).

    Padding positions are filled with 0 before summing (not multiplied by 0), so whatever they
    hold, even inf or NaN, cannot reach the result.
    """
    if x.dim() != 3 or keep.shape != x.shape[:2] or keep.dtype != torch.bool:
        raise ValueError(f"expected x (B, T, d) and boolean keep (B, T), got {tuple(x.shape)} and "
                         f"{keep.dtype} {tuple(keep.shape)}")
    count = keep.sum(dim=1, keepdim=True)  # (B, 1)
    if (count == 0).any():
        raise ValueError("an example has no real position to average over")
    return x.masked_fill(~keep[..., None], 0.0).sum(dim=1) / count.to(x.dtype)  # (B, d)


POOLINGS = ("cls", "mean")


class SequenceClassifier(nn.Module):
    """An encoder-only model with one label per sequence.

    pooling="cls": the vector at position 0, where the data must put a [CLS] token (BERT
    adds a dense + tanh "pooler" there first; this head is a single linear layer).
    pooling="mean": the mean over the real positions. With ``n_features`` (continuous frames)
    only mean pooling is available: there is no [CLS] token to read.
    """

    def __init__(self, cfg: ModelConfig, n_classes: int, *, pooling: str = "cls",
                 n_features: int | None = None, pad_id: int | None = None):
        super().__init__()
        check_count("n_classes", n_classes, 2)
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if pooling == "cls" and n_features is not None:
            raise ValueError("feature frames have no [CLS] token: use pooling='mean' with n_features")
        self.cfg = cfg
        self.pooling = pooling
        self.backbone = EncoderBackbone(cfg, n_features=n_features, pad_id=pad_id)
        self.dropout = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.d_model, n_classes)
        init_weights(self, cfg)

    def pool(self, encoded: Encoded) -> Tensor:
        if self.pooling == "cls":
            return encoded.x[:, 0]  # (B, d)
        return mean_pool(encoded.x, encoded.keep)  # (B, d)

    def _check_inputs(self, inputs: Tensor, labels: Tensor | None) -> None:
        """Shapes and dtypes of the token ids (frames are the backbone's to check) and the
        labels, then the values of both in one host sync."""
        ranges = []
        if self.backbone.frontend is None:
            ranges.append(IdRange("inputs", check_id_tensor("inputs", inputs), self.cfg.vocab_size))
        if labels is not None:
            check_id_tensor("labels", labels, what="class ids", shape="(B,)")
            if not isinstance(inputs, Tensor) or labels.size(0) != inputs.size(0):
                got = inputs.size(0) if isinstance(inputs, Tensor) else "?"
                raise ValueError(f"labels must have shape (B={got},), got {tuple(labels.shape)}")
            ranges.append(IdRange("labels", labels, self.classifier.out_features, IGNORE_INDEX))
        if ranges:
            check_id_values(*ranges)  # one host sync for ids and labels

    def forward(self, inputs: Tensor, labels: Tensor | None = None, *, lengths: Tensor | None = None,
                need_weights: bool = False) -> EncoderOnlyOutput:
        """inputs: ids (B, T) or frames (B, T, n_features); labels: (B,) class ids (IGNORE_INDEX
        leaves an example out of the loss, as in F.cross_entropy)."""
        self._check_inputs(inputs, labels)
        encoded = self.backbone(inputs, lengths=lengths, need_weights=need_weights, check_ids=False)
        logits = self.classifier(self.dropout(self.pool(encoded)))  # (B, n_classes)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)
        return EncoderOnlyOutput(logits, loss, encoded.weights)

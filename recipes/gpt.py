"""Byte-level GPT: a decoder-only transformer language model over the 256 byte values (no tokenizer).

GPT-2's architecture (pre-norm blocks, learned positions, GELU MLP, tied input/output
embedding) with ``torch.nn.functional.scaled_dot_product_attention`` (flash or memory-efficient
kernels where the device has them). AdamW decays only matrices and embeddings; the learning rate
warms up linearly and then follows a cosine to ``min_lr_ratio`` of its peak. Gradient clipping is
the trainer's (``trainer.gradient_clip_val``).

One module serves every strategy: on one device and under DDP it is a plain module; under
``ModelParallelStrategy`` (our FSDP, ``configs/strategy/fsdp.yaml``) ``configure_model`` shards each
block with FSDP2's ``fully_shard`` over the data-parallel mesh, then the root (embeddings, final
norm and head together, so the tied embedding and head stay one parameter).

Train it (``configs/gpt.yaml`` on a CPU, ``configs/gpt-124m.yaml`` on GPUs)::

    python -m recipes.fit --config configs/gpt.yaml
    python -m recipes.fit --config configs/gpt-124m.yaml --config configs/strategy/fsdp.yaml --trainer.devices 8

and sample from a checkpoint: ``python -m recipes.sample --ckpt PATH --prompt "def "``.

=============  ==============================================================
key            meaning
=============  ==============================================================
``train/loss`` cross-entropy per byte, nats (every logged step)
``val/loss``   cross-entropy per byte on the validation windows, nats
``val/bpb``    the same in bits per byte: ``val/loss / ln 2``
=============  ==============================================================

Throughput and MFU come from ``callbacks.throughput.TokenThroughput``, which reads this module's
``flops_per_batch`` (the PaLM estimate, :meth:`GPT.flops_per_token`).

Copy with it (paths under ``recipes/``, each folder with an ``__init__.py``): ``run/errors.py``, and
``callbacks/analysis/keys.py`` put beside it, under its own name (the import of keys falls back to that place when
no ``callbacks`` package is there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from typing_extensions import override

from .run.errors import check_optimizer

try:  # in this repository
    from callbacks.analysis import keys
except ModuleNotFoundError as missing:  # copied into another project (see "Copy with it" above)
    if missing.name != "callbacks":
        raise
    from . import keys  # type: ignore[no-redef]

LN2 = math.log(2.0)


def bits_per_byte(loss_nats: torch.Tensor | float) -> torch.Tensor | float:
    """Cross-entropy per byte in nats -> bits per byte (divide by ln 2)."""
    return loss_nats / LN2


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps, then a cosine
    from 1 down to ``min_ratio`` at ``decay_steps``, and ``min_ratio`` after it.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.resid_dropout = nn.Dropout(dropout)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, channels = x.shape
        q, k, v = (t.view(batch, length, self.n_head, channels // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(channels, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, length, channels)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=False), nn.Dropout(dropout))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final norm and a head tied to the token embedding."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one parameter
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2: scale the residual projections by 1/sqrt(2L)
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.size(1)
        if length > self.block_size:
            raise ValueError(f"sequence of length {length} is longer than block_size={self.block_size}")
        pos = torch.arange(length, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPT(pl.LightningModule):
    """A byte-level GPT language model.

    Args:
        vocab_size: vocabulary size (256: bytes).
        block_size: longest context, in bytes.
        n_layer: transformer blocks.
        n_head: attention heads per block (must divide ``n_embd``).
        n_embd: width of the residual stream.
        dropout: dropout on embeddings, attention and residual branches.
        optimizer: the optimizer, from the config (default AdamW, lr 1e-3, betas (0.9, 0.95),
            weight decay 0.1); it receives two parameter groups, and biases, norms and
            position embeddings get ``weight_decay=0``.
        warmup_steps: optimizer steps of linear learning-rate warmup.
        min_lr_ratio: the cosine decay ends at this fraction of the peak learning rate.
        decay_steps: step at which the decay ends (default: the trainer's total steps; set it to keep
            the schedule unchanged when a run is relaunched with a larger ``max_steps``).
        compile: ``torch.compile`` each block (after sharding, when sharded).

    Raises:
        ValueError: when ``n_head`` does not divide ``n_embd``, a size is not positive, or the optimizer refuses
            a value (a negative learning rate).

    Example::

        model = GPT(block_size=64, n_layer=2, n_head=2, n_embd=32)
        logits = model(torch.zeros(1, 64, dtype=torch.long))   # (1, 64, 256)
        text = model.generate(torch.tensor([[100, 101, 102]]), max_new_tokens=10)
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        optimizer: OptimizerCallable = lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        decay_steps: int | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):
            if value < 1:
                raise ValueError(f"GPT({name}={value!r}) must be >= 1.")
        if n_embd % n_head:
            raise ValueError(f"GPT(n_head={n_head!r}) must divide n_embd={n_embd!r}.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"GPT(dropout={dropout!r}) must lie in [0, 1).")
        if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"GPT(warmup_steps={warmup_steps!r}, min_lr_ratio={min_lr_ratio!r}): warmup must be "
                             ">= 0 and the ratio in [0, 1].")
        self.save_hyperparameters(logger=False, ignore=["optimizer"])
        self.optimizer_factory = optimizer
        self.transformer = Transformer(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
        #: FLOPs of the latest batch (training: forward + backward; validation: forward), for ThroughputMonitor.
        self.flops_per_batch: int | None = None
        check_optimizer("GPT", lambda: self.optimizer_factory(self._param_groups()))

    # ----------------------------------------------------------------- sizes
    def num_params(self, exclude_position_embedding: bool = True) -> int:
        """Parameters, the tied embedding/head counted once; by default without the position embedding
        (a table lookup: it costs no FLOPs, unlike the token embedding that doubles as the head)."""
        total = sum(p.numel() for p in self.transformer.parameters())
        if exclude_position_embedding:
            total -= self.transformer.wpe.weight.numel()
        return total

    def flops_per_token(self, seq_len: int | None = None, training: bool = True) -> int:
        """PaLM's estimate (Chowdhery et al. 2022, app. B): ``6 N + 12 L H Q T`` FLOPs per token for a
        training step, a third of it for a forward pass; ``H Q = n_embd`` and ``T`` the sequence length."""
        hp = self.hparams
        seq_len = hp.block_size if seq_len is None else seq_len
        passes = 3 if training else 1  # the backward pass costs two forwards
        return passes * (2 * self.num_params() + 4 * hp.n_layer * hp.n_embd * seq_len)

    @override
    def setup(self, stage: str) -> None:
        try:
            datamodule = self.trainer.datamodule
        except RuntimeError:  # set up by hand, with no Trainer attached
            datamodule = None
        data_block = getattr(datamodule, "block_size", None)
        if data_block is not None and data_block > self.hparams.block_size:
            raise ValueError(f"GPT(block_size={self.hparams.block_size}) is shorter than the data's windows "
                             f"(block_size={data_block}): set both to the same value.")

    # ------------------------------------------------------------- sharding
    @override
    def configure_model(self) -> None:
        blocks = self.transformer.blocks
        mesh = self.device_mesh
        if mesh is not None and not getattr(self, "_sharded", False):
            from torch.distributed.fsdp import fully_shard

            dp_mesh = mesh["data_parallel"]
            for block in blocks:
                fully_shard(block, mesh=dp_mesh)
            # The root unit holds wte, wpe, ln_f and lm_head; wte and lm_head are one parameter.
            fully_shard(self.transformer, mesh=dp_mesh)
            self._sharded = True
        if self.hparams.compile and not getattr(self, "_compiled", False):
            for block in blocks:
                block.compile()
            self._compiled = True

    # ---------------------------------------------------------------- steps
    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.transformer(idx)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) of an ``(inputs, targets)`` batch: what training minimises."""
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0]
        self.flops_per_batch = self.flops_per_token(x.size(1)) * x.size(0)
        loss = self.loss(batch)
        self.log(keys.TRAIN_LOSS_KEY, loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x = batch[0]
        self.flops_per_batch = self.flops_per_token(x.size(1), training=False) * x.size(0)
        loss = self.loss(batch)
        self.log(keys.VAL_LOSS_KEY, loss, batch_size=x.size(0), sync_dist=True)
        self.log(keys.VAL_BPB_KEY, bits_per_byte(loss), batch_size=x.size(0), sync_dist=True, prog_bar=True)

    # ------------------------------------------------------------ optimizer
    def _param_groups(self) -> list[dict[str, Any]]:
        """Matrices and the token embedding decay; biases, norms and the position embedding do not."""
        decay, no_decay = [], []
        for name, param in self.transformer.named_parameters():
            if not param.requires_grad:
                continue
            (decay if param.dim() >= 2 and not name.startswith("wpe.") else no_decay).append(param)
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    @override
    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self._param_groups())
        hp = self.hparams
        total = hp.decay_steps if hp.decay_steps is not None else int(self.trainer.estimated_stepping_batches)
        schedule: Callable[[int], float] = partial(lr_factor, warmup_steps=hp.warmup_steps,
                                                   decay_steps=max(total, 1), min_ratio=hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled bytes to ``idx`` (``(B, T)`` int64); the context is cropped
        to ``block_size``. ``temperature=0`` is greedy decoding; ``top_k`` keeps the k likeliest bytes."""
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.hparams.block_size:])[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.size(-1):
                    kth = torch.topk(logits, top_k).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was_training)
        return idx

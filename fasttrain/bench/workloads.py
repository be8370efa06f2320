"""Synthetic training workloads that every benchmark peer runs identically.

A workload bundles a model factory (seeded, so every peer starts from the same weights), a loss
function, an optimizer factory, and a synthetic dataset whose batches cost almost nothing to fetch.
Nothing is downloaded: ``hf-gpt2`` builds transformers' ``GPT2LMHeadModel`` from a ``GPT2Config``.

The dataset implements ``__getitems__``: the DataLoader then asks for a whole batch in one call, and
:func:`passthrough_collate` hands that batch on untouched. Batches are views into a small pool of
pre-generated tensors, so fetching one is a slice, not a gather and a stack: the benchmark measures
the training loop, not data preparation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

WORKLOADS = ("mlp", "convnet", "gpt", "hf-gpt2", "overhead")

#: batches held in memory per dataset; a dataset of any length cycles through them.
_POOL_BATCHES = 4


class PeerUnavailable(RuntimeError):
    """A peer cannot run here (missing package or device); the message says why. A workload whose
    model needs a missing package raises it from its model factory, so every peer reports it."""


def passthrough_collate(batch):
    """Collate function for datasets whose ``__getitems__`` already returns a whole batch."""
    return batch


class SyntheticBatches(torch.utils.data.Dataset):
    """A dataset of ``num_batches * batch_size`` samples backed by a few pre-built batches.

    ``__getitems__`` returns ``(inputs, targets)`` for a list of indices. A batch-aligned run of
    consecutive indices (what an unshuffled DataLoader asks for) is served as a view; any other
    index list falls back to one gather per tensor, which is still a single indexing op.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int, num_batches: int):
        if inputs.shape[0] != targets.shape[0] or inputs.shape[0] % batch_size:
            raise ValueError("the pool must hold a whole number of batches")
        self.inputs = inputs
        self.targets = targets
        self.batch_size = batch_size
        self.num_batches = num_batches
        self._pool_len = inputs.shape[0]

    def __len__(self) -> int:
        return self.num_batches * self.batch_size

    def __getitem__(self, index: int):
        i = index % self._pool_len
        return self.inputs[i], self.targets[i]

    def __getitems__(self, indices):
        n = len(indices)
        start = indices[0] % self._pool_len
        # Cheap contiguity test: the first and last index decide it for the sequential sampler;
        # a shuffled list almost never passes, and then the gather below is still correct.
        if n and indices[-1] - indices[0] == n - 1 and start + n <= self._pool_len:
            return self.inputs[start : start + n], self.targets[start : start + n]
        idx = torch.as_tensor(indices) % self._pool_len
        return self.inputs[idx], self.targets[idx]


# --------------------------------------------------------------------------------------------
# models


class MLP(nn.Module):
    def __init__(self, in_features: int, width: int, num_classes: int, depth: int = 3):
        super().__init__()
        layers = []
        d = in_features
        for _ in range(depth - 1):
            layers += [nn.Linear(d, width), nn.GELU()]
            d = width
        layers.append(nn.Linear(d, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def _conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU())


class ConvNet(nn.Module):
    """A small CIFAR-style net: three conv-bn stages with pooling, then a linear head."""

    def __init__(self, widths: Tuple[int, int, int], num_classes: int = 10):
        super().__init__()
        w1, w2, w3 = widths
        self.features = nn.Sequential(
            _conv_bn(3, w1),
            _conv_bn(w1, w2),
            nn.MaxPool2d(2),
            _conv_bn(w2, w2),
            _conv_bn(w2, w3),
            nn.MaxPool2d(2),
            _conv_bn(w3, w3),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(w3, num_classes)

    def forward(self, x):
        x = self.features(x)
        return self.head(torch.amax(x, dim=(2, 3)))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        k = k.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 architecture: learned positions, pre-norm blocks, output head tied to the embedding."""

    def __init__(self, n_layers: int, d_model: int, n_heads: int, seq_len: int, vocab: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("pos", torch.arange(seq_len), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # GPT-2 scales the residual projections down with depth.
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(self.pos[:t])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over every position; a module-level function so it pickles."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def hf_causal_lm_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """:func:`gpt_loss` of a transformers causal LM's output (its ``logits``); the targets are the
    inputs shifted by one token already, so the model is called without ``labels``."""
    return gpt_loss(outputs.logits, targets)


def _transformers_gpt2():
    """transformers' GPT-2 classes, or :class:`PeerUnavailable` saying how to get them."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise PeerUnavailable(f"transformers is not installed ({exc}); pip install transformers") from exc
    return GPT2Config, GPT2LMHeadModel


def hf_gpt2(n_layers: int, d_model: int, n_heads: int, seq_len: int, vocab: int) -> nn.Module:
    """``GPT2LMHeadModel`` built from a config (no download), with dropout off like :class:`GPT`,
    no key/value cache (training) and torch's fused attention."""
    GPT2Config, GPT2LMHeadModel = _transformers_gpt2()
    config = GPT2Config(
        n_layer=n_layers, n_embd=d_model, n_head=n_heads, n_positions=seq_len, vocab_size=vocab,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="sdpa",
        # GPT-2's special token is the last of its vocabulary; so it is at every size
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )
    return GPT2LMHeadModel(config)


# --------------------------------------------------------------------------------------------
# workload description


@dataclass
class Workload:
    """Everything a peer needs to run identical training steps."""

    name: str
    size: str
    device: torch.device
    batch_size: int
    model_factory: Callable[[], nn.Module]
    loss_func: Callable
    lr: float
    #: the autocast dtype on the device, or None for full precision.
    amp_dtype: Optional[torch.dtype]
    channels_last: bool
    dataset: SyntheticBatches
    #: training FLOPs (forward + backward) per sample; per token for language models.
    flops_per_sample: Optional[float]
    flops_per_token: Optional[float] = None
    tokens_per_sample: Optional[int] = None
    seed: int = 0
    config: Dict[str, object] = field(default_factory=dict)
    #: AdamW's keyword arguments beyond the learning rate (empty: torch's default implementation)
    optimizer_options: Dict[str, object] = field(default_factory=dict)

    collate_fn = staticmethod(passthrough_collate)

    @property
    def items_per_step(self) -> int:
        """Samples (or tokens, for language models) in one optimizer step."""
        return self.batch_size * (self.tokens_per_sample or 1)

    @property
    def items_name(self) -> str:
        return "tokens" if self.tokens_per_sample else "samples"

    @property
    def flops_per_step(self) -> Optional[float]:
        if self.flops_per_token is not None and self.tokens_per_sample:
            return self.flops_per_token * self.tokens_per_sample * self.batch_size
        if self.flops_per_sample is not None:
            return self.flops_per_sample * self.batch_size
        return None

    def make_model(self) -> nn.Module:
        """A fresh model on the workload's device, identical for every call (seeded)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self.model_factory()
        model = model.to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    @property
    def optimizer_name(self) -> str:
        """AdamW and its implementation choices, as the reports show them."""
        options = ", ".join(f"{k}={v}" for k, v in sorted(self.optimizer_options.items()))
        return f"AdamW({options})" if options else "AdamW"

    def make_optimizer(self, model: nn.Module, capturable: bool = False) -> torch.optim.Optimizer:
        """AdamW with the workload's implementation choices (:attr:`optimizer_options`);
        ``capturable`` for CUDA-graph capture, which needs the step count kept on the device."""
        kwargs = dict(self.optimizer_options)
        if capturable:
            kwargs["capturable"] = True
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.0, **kwargs)

    def resize(self, num_batches: int) -> None:
        """Make one epoch of the dataset hold at least ``num_batches`` batches."""
        self.dataset.num_batches = max(self.dataset.num_batches, num_batches)

    def describe(self) -> Dict[str, object]:
        return {
            "workload": self.name,
            "size": self.size,
            "batch_size": self.batch_size,
            "device": str(self.device),
            "amp_dtype": str(self.amp_dtype).replace("torch.", "") if self.amp_dtype else "fp32",
            "channels_last": self.channels_last,
            "items": self.items_name,
            "items_per_step": self.items_per_step,
            "flops_per_step": self.flops_per_step,
            "optimizer": self.optimizer_name,
            **self.config,
        }


SIZES: Dict[str, Dict[str, Dict[str, object]]] = {
    "mlp": {
        "tiny": {"in_features": 32, "width": 64, "num_classes": 10},
        "small": {"in_features": 256, "width": 256, "num_classes": 10},
    },
    # Linear 16-32-4: a step whose arithmetic takes a few microseconds, so what a peer's step
    # costs is its own Python, as a GPU step looks to the host that launches it
    "overhead": {
        "tiny": {"in_features": 16, "width": 32, "num_classes": 4, "depth": 2},
    },
    "convnet": {
        "tiny": {"widths": (8, 16, 32)},
        "small": {"widths": (32, 64, 128)},
    },
    "gpt": {
        "tiny": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 64, "vocab": 256},
        "small": {"n_layers": 6, "d_model": 384, "n_heads": 6, "seq_len": 256, "vocab": 8192},
        "124m": {"n_layers": 12, "d_model": 768, "n_heads": 12, "seq_len": 1024, "vocab": 50257},
    },
}
# the transformers GPT-2 at the same sizes as the hand-written one
SIZES["hf-gpt2"] = dict(SIZES["gpt"])

# the default MLP is the overhead-bound one: its step is small enough that per-step framework
# work shows in the ratios
DEFAULT_SIZE = {"mlp": "tiny", "convnet": "small", "gpt": "tiny", "hf-gpt2": "tiny", "overhead": "tiny"}
#: sizes that differ on CUDA: the transformers GPT-2 is measured at GPT-2's own 124M config
DEFAULT_SIZE_CUDA = dict(DEFAULT_SIZE, **{"hf-gpt2": "124m"})
DEFAULT_BATCH = {"mlp": 64, "convnet": 512, "gpt": 8, "hf-gpt2": 8, "overhead": 16}
#: on a CPU the convnet at batch 512 spends minutes per peer; 32 keeps a peer well under a minute
#: on two cores while still timing real convolution work
DEFAULT_BATCH_CPU = {"mlp": 64, "convnet": 32, "gpt": 8, "hf-gpt2": 8, "overhead": 16}


def default_size(name: str, device: str | torch.device) -> str:
    """The size a workload uses unless told otherwise, per device type."""
    return (DEFAULT_SIZE_CUDA if torch.device(device).type == "cuda" else DEFAULT_SIZE)[name]


def default_batch_size(name: str, device: str | torch.device) -> int:
    """The batch a workload uses unless told otherwise, per device type."""
    table = DEFAULT_BATCH if torch.device(device).type == "cuda" else DEFAULT_BATCH_CPU
    return table[name]


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Page-locked source memory lets every peer copy batches to the GPU asynchronously.
    return t.pin_memory() if device.type == "cuda" else t


def _dense_flops(model: nn.Module, example: torch.Tensor, loss_func, target) -> float:
    """Training FLOPs of one forward + backward, counted by PyTorch's flop counter."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss_func(model(example), target).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def gpt_flops_per_token(n_layers: int, d_model: int, seq_len: int, num_params: int) -> float:
    """6 N for the weight matmuls (forward 2 N, backward 4 N) plus 12 L d T for attention scores
    and values, counted without the causal mask's saving (the convention of the PaLM paper)."""
    return 6.0 * num_params + 12.0 * n_layers * d_model * seq_len


#: workloads trained on next-token prediction, counted in tokens
_LANGUAGE_MODELS = ("gpt", "hf-gpt2")


def make_workload(
    name: str,
    size: Optional[str] = None,
    device: str | torch.device = "cpu",
    batch_size: Optional[int] = None,
    channels_last: bool = False,
    precision: Optional[str] = None,
    num_batches: int = 64,
    seed: int = 0,
) -> Workload:
    """Build a workload. ``precision`` is ``"fp32"`` or ``"bf16"`` (autocast); by default bf16
    for the language models on CUDA and fp32 otherwise. ``hf-gpt2`` needs transformers to train;
    without it the workload is still built and each peer reports itself unavailable."""
    if name not in SIZES:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    size = size or default_size(name, device)
    if size not in SIZES[name]:
        raise ValueError(
            f"size {size!r} does not exist for workload {name!r}; choose one of {', '.join(SIZES[name])}"
        )
    if channels_last and name != "convnet":
        raise ValueError("channels_last applies to the convnet workload only; drop --channels-last")
    device = torch.device(device)
    batch_size = batch_size or default_batch_size(name, device)
    if batch_size < 1:
        raise ValueError("batch size must be at least 1")
    if precision is None:
        precision = "bf16" if (name in _LANGUAGE_MODELS and device.type == "cuda") else "fp32"
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16, not {precision!r}")
    amp_dtype = torch.bfloat16 if precision == "bf16" else None
    cfg = dict(SIZES[name][size])
    gen = torch.Generator().manual_seed(seed + 1)
    pool = _POOL_BATCHES * batch_size

    optimizer_options = {}
    if name in ("mlp", "overhead"):
        factory = lambda: MLP(cfg["in_features"], cfg["width"], cfg["num_classes"], cfg.get("depth", 3))  # noqa: E731
        inputs = torch.randn(pool, cfg["in_features"], generator=gen)
        targets = torch.randint(0, cfg["num_classes"], (pool,), generator=gen)
        loss_func, lr = nn.CrossEntropyLoss(), 1e-3
        if name == "overhead":
            # One call updates every parameter, as a GPU's fused AdamW is one launch. On the CPU,
            # torch's default (one tensor at a time) spends about 140 microseconds per step on
            # these four small tensors, nearly half the bare loop's step, where the fused one
            # spends about 90: the arithmetic would hide the host work this workload measures.
            optimizer_options = {"fused": True}
    elif name == "convnet":
        factory = lambda: ConvNet(cfg["widths"])  # noqa: E731
        inputs = torch.randn(pool, 3, 32, 32, generator=gen)
        if channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        targets = torch.randint(0, 10, (pool,), generator=gen)
        loss_func, lr = nn.CrossEntropyLoss(), 1e-3
    else:
        model_class = GPT if name == "gpt" else hf_gpt2
        factory = lambda: model_class(cfg["n_layers"], cfg["d_model"], cfg["n_heads"], cfg["seq_len"], cfg["vocab"])  # noqa: E731
        tokens = torch.randint(0, cfg["vocab"], (pool, cfg["seq_len"] + 1), generator=gen)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        loss_func, lr = (gpt_loss if name == "gpt" else hf_causal_lm_loss), 3e-4
        if device.type == "cuda":
            # What transformer training on a GPU uses: one fused kernel for every parameter
            # (every peer steps with it; the graphed engines capture it as it is).
            optimizer_options = {"fused": True}

    flops_per_sample = flops_per_token = tokens_per_sample = None
    if name in _LANGUAGE_MODELS:
        tokens_per_sample = cfg["seq_len"]
        try:
            with torch.device("meta"):
                meta = factory()
        except PeerUnavailable:
            meta = None  # every peer reports why when it builds the model
        if meta is not None:
            # Position embeddings are a lookup, not a matmul; the tied token embedding is counted
            # once (parameters() yields a shared tensor once), for the output head.
            wpe = meta.wpe if name == "gpt" else meta.transformer.wpe
            n = sum(p.numel() for p in meta.parameters()) - wpe.weight.numel()
            flops_per_token = gpt_flops_per_token(cfg["n_layers"], cfg["d_model"], cfg["seq_len"], n)
            cfg["params"] = n
    else:
        with torch.random.fork_rng(devices=[]):
            probe = factory()
        flops_per_sample = _dense_flops(probe, inputs[:2], loss_func, targets[:2]) / 2
        cfg["params"] = sum(p.numel() for p in probe.parameters())

    return Workload(
        name=name,
        size=size,
        device=device,
        batch_size=batch_size,
        model_factory=factory,
        loss_func=loss_func,
        lr=lr,
        amp_dtype=amp_dtype,
        channels_last=channels_last,
        dataset=SyntheticBatches(_pinned(inputs, device), _pinned(targets, device), batch_size, num_batches),
        flops_per_sample=flops_per_sample,
        flops_per_token=flops_per_token,
        tokens_per_sample=tokens_per_sample,
        seed=seed,
        config=cfg,
        optimizer_options=optimizer_options,
    )

"""Which parameters train, as the compiled code sees it.

Finetuning unfreezes layers between epochs (a callback's ``on_train_epoch_start``) or between two
``train()`` calls (``ModelFreezer.unfreeze`` and ``add_param_group``). Code that dynamo compiled
while a parameter was frozen computes no gradient for it; dynamo guards on ``requires_grad`` and
traces such code again once the parameter trains, except where it does not: torch 2.11's guards
skip that check for parameters reached through a module (pytorch/pytorch#139476, fixed in later
releases), so the unfrozen layers get no gradient, the optimizer skips them, and they never train,
with no error and a normal-looking loss. Making new compiled functions does not help there when the
graph breaks: the frames dynamo resumes in are the model's own code, whose caches stay.

:func:`notice_trainable_change` runs at the start of each training epoch, after the callbacks'
``on_train_epoch_start``: when the set of trainable parameters changed since the last epoch (of
this run or an earlier one) and dynamo would not see it (:func:`dynamo_sees_requires_grad_changes`
finds out once per process, by trying), every code object dynamo compiled is forgotten
(``torch._dynamo.reset_code_caches``), so the next steps are traced with the parameters as they
are. That costs a compile of what runs next, once per change; a torch whose guards see the
change recompiles only what the change concerns, on its own.
"""

from __future__ import annotations

import functools
import types
import weakref

import torch

from fasttrain.engine.compile_cache import with_own_dynamo_cache

#: the model -> ``requires_grad`` of each of its parameters at the last epoch start
_LAST_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _unwrapped(model):
    # DDP's wrapper and fasttrain.lightning's step module hold the module as ``.module``; the
    # wrapper may be new for each run, the module is the user's
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def notice_trainable_change(model) -> bool:
    """Record which parameters of ``model`` train; returns True when that changed since the
    last call for this model (after forgetting dynamo's compiled code, where dynamo would not
    see the change itself)."""
    model = _unwrapped(model)
    trainable = tuple(p.requires_grad for p in model.parameters())
    last = _LAST_SEEN.get(model)
    _LAST_SEEN[model] = trainable
    if last is None or last == trainable:
        return False
    if not dynamo_sees_requires_grad_changes():
        torch._dynamo.reset_code_caches()
    return True


def _frozen_layer_loss(holder, x):
    return holder.layer(x).sum()


@functools.lru_cache(maxsize=None)
def dynamo_sees_requires_grad_changes() -> bool:
    """Whether dynamo traces a function again after a parameter it reads through a module
    starts to require gradients. Found by trying, once per process: a frozen layer's loss is
    compiled, the layer unfrozen and the loss computed again; reused, the stale code returns a
    loss without a gradient. A probe that fails counts as not seen (the caller then forgets the
    compiled code, which is only slower)."""
    try:
        with torch.random.fork_rng(devices=[]):  # the layer's initialisation draws no number of the run's
            layer = torch.nn.Linear(2, 1)
        layer.requires_grad_(False)
        holder = types.SimpleNamespace(layer=layer)
        fn = with_own_dynamo_cache(_frozen_layer_loss)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)
        x = torch.ones(1, 2)
        compiled(holder, x)
        layer.requires_grad_(True)
        return bool(compiled(holder, x).requires_grad)
    except Exception:  # noqa: BLE001 - a probe that cannot run answers "not seen"
        return False

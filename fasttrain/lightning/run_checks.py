"""Lightning's checks of a fit's settings against the module, made before the fit's first hook,
with Lightning's exception types and words."""

from __future__ import annotations

from fasttrain.lightning.errors import LightningConfigError



def check_manual_optimization(lt) -> None:
    """Under manual optimization: no automatic clipping or accumulation (Lightning's errors, in
    its order), and no fp16 loss scaling (fasttrain runs manual optimization eagerly without
    accelerate's scaler)."""
    if lt.gradient_clip_val is not None and lt.gradient_clip_val > 0:
        raise LightningConfigError(
            "Automatic gradient clipping is not supported for manual optimization."
            f" Remove `Trainer(gradient_clip_val={lt.gradient_clip_val})` or switch to automatic optimization."
        )
    if lt.accumulate_grad_batches != 1:
        raise LightningConfigError(
            "Automatic gradient accumulation is not supported for manual optimization."
            f" Remove `Trainer(accumulate_grad_batches={lt.accumulate_grad_batches})` or switch to automatic"
            " optimization."
        )
    if lt._args.mixed_precision == "fp16":
        raise ValueError("precision='16-mixed' with manual optimization is not supported; use 'bf16-mixed'")

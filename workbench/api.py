"""swinbench's public Python API: take a recipe into your own training loop.

    import timm, torch
    from workbench.api import optimize_swin

    model = timm.create_model("swin_tiny_patch4_window7_224", num_classes=100).cuda()
    swin = optimize_swin(model, "fmha-graph", optimizer={"lr": 1e-3, "weight_decay": 0.05}, grad_clip=5.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(swin.optimizer, T_max=10_000)
    for images, targets in loader:
        loss = swin.train_step(images, targets)     # forward, backward, clip, fused step: one CUDA graph
        schedule.step()
    logits = swin.predict(val_images)
    torch.save(swin.state_dict(), "swin.pt")        # loads into a plain timm Swin as it is

Under torchrun (one process per GPU, the process group initialized), the same call wraps the patched
model in DistributedDataParallel; `distributed={"bucket_cap_mb": 50}` or a `DataParallel` sets DDP's
throughput settings, and each rank passes its own shard of the global batch to train_step.
`distributed="fsdp"` or a `FullyShard` shards the model with FSDP2 instead (each rank holds 1/N of the
weights, gradients and optimizer state); `state_dict()` still gives the whole weights.

For inference, the recipe's inference form (bf16 weights, fc1's GELU in its GEMM, fp8/int8 Linears),
each batch shape replayed as a CUDA graph on a GPU:

    swin = optimize_swin_inference(model, "dense")
    logits = swin(images)

A Swin inside a model of your own (a detection backbone, a features_only model, a framework's loop):

    backbone = timm.create_model("swin_base_patch4_window7_224", features_only=True).cuda()
    patch = patch_swin(backbone, "fmha")            # the recipe's kernels, in place; weights untouched
    print(patch.describe())                          # what it applied, and what your loop adds (autocast, ...)

These names are the stable surface; everything else in `workbench` may change between versions.
docs/training.md says what each call does and guarantees.
"""
from workbench.optimize.distributed import DataParallel, FullyShard
from workbench.optimize.inference import GraphFallbackWarning, InferenceSwin, optimize_swin_inference
from workbench.optimize.patching import SwinPatch, patch_swin
from workbench.optimize.recipes import RecipeUnavailable
from workbench.optimize.trainer import GRAPH_WARMUP_STEPS, OptimizedSwin, optimize_swin

__all__ = ["optimize_swin", "OptimizedSwin", "optimize_swin_inference", "InferenceSwin", "patch_swin", "SwinPatch",
           "DataParallel", "FullyShard", "GraphFallbackWarning", "RecipeUnavailable", "GRAPH_WARMUP_STEPS"]

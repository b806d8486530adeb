"""The correctness gate: does a recipe stage still compute what the baseline computes?

Both are built from the same seed (so the same initial weights, checked by a digest of the state dict
taken before any pass runs) and run ONE forward + backward on the same synthetic batch, without an
optimizer step. Compared with the baseline (fp32, TF32 off): the logits (N, classes), the loss, and the
gradients of a few named parameters (first block's qkv weight and norm1 weight, its relative position
bias table, the head weight). Metrics per tensor: max |a - b| and the relative L2 error ||a - b|| / ||b||.
Tolerances come from the recipe, per precision (`recipes.gate_tolerance`):

    logits_rel: relative L2 error of the logits     loss_atol: |loss - loss_ref|
    grad_rel:   relative L2 error of each gradient  (max |a - b| is recorded, not gated)

`top1_agreement` (the share of the batch whose top-1 class is the baseline's) is recorded, not gated.

Trained weights (`apply --mode infer --checkpoint`): every stage and the baseline also run the held-out
images (`Workload.heldout_outputs`), and `metrics.heldout` holds the stage's accuracy, the baseline's, the
drop in points, the top-1 agreement with the baseline and the logits' relative L2 error over them. Two
optional tolerances gate these where a recipe sets them:

    accuracy_drop:  the most accuracy (in points) a stage may lose against the baseline
    top1_agreement: the least share of held-out images whose top-1 class must be the baseline's
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from workbench.optimize.workload import Workload, WorkloadConfig

# (label, how to find it): the first parameter whose name ends with the suffix.
GATE_PARAMETERS = (
    ("qkv.weight", "attn.qkv.weight"),
    ("norm1.weight", "norm1.weight"),
    ("relative_position_bias_table", "relative_position_bias_table"),
    ("head.weight", "head.fc.weight"),
)


def gate_parameter_names(model: torch.nn.Module) -> list[str]:
    """Full names of the parameters the gate compares (first block's qkv/norm1/bias table, head)."""
    names = [n for n, _ in model.named_parameters()]
    picked = []
    for _, suffix in GATE_PARAMETERS:
        hit = next((n for n in names if n.endswith(suffix)), None)
        if hit is not None:
            picked.append(hit)
    if not picked:
        picked = names[:1] + names[-1:]
    return picked


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes, bytes): equal digests = identical weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


@dataclass
class GateOutputs:
    """One forward + backward: logits (N, classes) fp32 on the CPU, loss, gradients by parameter name (CPU fp32)."""

    logits: torch.Tensor
    loss: float
    grads: dict[str, torch.Tensor | None]
    weights_digest: str = ""
    heldout_logits: torch.Tensor | None = None    # a trained model's held-out images (N, classes), fp32 CPU
    heldout_labels: torch.Tensor | None = None

    def to_state(self) -> dict:
        return {"logits": self.logits, "loss": self.loss, "grads": self.grads, "weights_digest": self.weights_digest,
                "heldout_logits": self.heldout_logits, "heldout_labels": self.heldout_labels}

    @classmethod
    def from_state(cls, state: dict) -> "GateOutputs":
        return cls(state["logits"], float(state["loss"]), dict(state["grads"]), state["weights_digest"],
                   state.get("heldout_logits"), state.get("heldout_labels"))


def capture_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The gate's parameters as objects, taken before passes run: a pass that swaps a module but keeps
    its parameters (or renames the module) is still found through these."""
    params = dict(model.named_parameters())
    return {n: params[n] for n in gate_parameter_names(model)}


def forward_backward(workload: Workload, params: dict[str, torch.nn.Parameter]) -> GateOutputs:
    """One forward + backward of a prepared workload (no optimizer step, no loss scaling), gradients
    of `params` copied to the CPU, then zeroed so the workload can train from the same state.
    An inference workload runs the forward only, under inference_mode, and has no gradients."""
    if workload.config.mode == "infer":
        with torch.inference_mode():
            logits, loss = workload.forward_loss()
        out = GateOutputs(logits.detach().float().cpu(), float(loss.detach().float().cpu()), {})
        if workload.has_heldout:
            out.heldout_logits, out.heldout_labels = workload.heldout_outputs()
        return out
    workload.model.zero_grad(set_to_none=True)
    # The forward the timed steps use (compiled when the stage compiles), so the gate checks
    # exactly what is measured.
    logits, loss = workload.forward_loss()
    loss.backward()
    by_name = dict(workload.model.named_parameters())
    grads = {}
    for name, p in params.items():
        g = p.grad if p.grad is not None else getattr(by_name.get(name), "grad", None)
        if hasattr(g, "full_tensor"):       # a DTensor shard (FSDP put a new parameter in p's place): whole
            g = g.full_tensor()
        grads[name] = None if g is None else g.detach().float().cpu().clone()
    out = GateOutputs(logits.detach().float().cpu(), float(loss.detach().float().cpu()), grads)
    workload.model.zero_grad(set_to_none=True)
    return out


def activation_dtypes(workload: Workload) -> dict[str, str]:
    """The dtype of each top-level part's output (patch embedding, every stage, the final norm, the head)
    in one forward of the stage's model under its precision, without autograd and without torch.compile's
    wrapper: what precision the activations are kept in. A pass that swaps in a kernel can also change
    that (a fused LayerNorm returning bf16 where autocast's returns fp32 keeps stage 1's residual stream
    in bf16), which the gate's tolerance may not catch; the report shows where stages differ."""
    from workbench.optimize.passes._swin import swin_stages

    model = workload.model
    stages_attr, stages = swin_stages(model)
    parts = []
    for name, child in model.named_children():
        if name == stages_attr:
            parts += [(f"{name}.{i}", m) for i, m in enumerate(stages)]
        elif name in ("patch_embed", "norm", "head"):
            parts.append((name, child))
    seen: dict[str, str] = {}

    def hook(name):
        def record(module, args, out):
            if isinstance(out, tuple) and out:  # a stage handing its last MLP branch on: (x, branch)
                out = out[0]
            if isinstance(out, torch.Tensor):
                seen.setdefault(name, str(out.dtype).replace("torch.", ""))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in parts]
    try:
        with torch.inference_mode(), workload.ctx.precision.autocast(workload.ctx.device.type):
            model(workload.x)
    finally:
        for h in handles:
            h.remove()
    return {n: seen[n] for n, _ in parts if n in seen}


def compute_reference(config: WorkloadConfig) -> GateOutputs:
    """The baseline's outputs: the timm model as built, fp32 with TF32 off, one forward + backward
    (forward only for an inference workload)."""
    from dataclasses import replace

    workload = Workload.build(replace(config, precision="fp32"))
    digest = weights_digest(workload.model)
    params = capture_parameters(workload.model)
    workload.prepare()
    out = forward_backward(workload, params)
    out.weights_digest = digest
    return out


def _tensor_metrics(a: torch.Tensor, ref: torch.Tensor) -> dict:
    if a.shape != ref.shape:
        return {"max_abs": None, "rel_l2": None, "shape": list(a.shape), "ref_shape": list(ref.shape)}
    diff = (a.double() - ref.double())
    denom = ref.double().norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    return {"max_abs": diff.abs().max().item() if diff.numel() else 0.0, "rel_l2": rel}


def top1_agreement(logits: torch.Tensor, ref: torch.Tensor) -> float | None:
    """The share of rows of (N, classes) logits whose argmax is the reference's (None for other shapes).
    Recorded, not gated: on the workload's random batch through an untrained model the classes are nearly
    tied, so a correct low-precision stage can flip some rows; on a trained model it is the figure that
    says what quantization costs."""
    if logits.dim() != 2 or logits.shape != ref.shape or logits.shape[0] == 0:
        return None
    return (logits.argmax(-1) == ref.argmax(-1)).double().mean().item()


def _exceeds(value, limit) -> bool:
    # NaN and a missing value both fail: `not value <= limit` is True for NaN.
    return value is None or not value <= limit


@dataclass
class GateResult:
    status: str                      # PASS | FAIL | REFERENCE | SKIP
    tolerance: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    reason: str | None = None

    def to_dict(self) -> dict:
        return {"status": self.status, "tolerance": self.tolerance, "metrics": self.metrics, "reason": self.reason}


def compare(out: GateOutputs, ref: GateOutputs, tolerance: dict[str, float], *, is_reference: bool = False) -> GateResult:
    """PASS when logits, loss and every gradient are within `tolerance` and the initial weights match.
    `is_reference` (the baseline stage itself): metrics are recorded (a determinism check), status REFERENCE."""
    failures = []
    metrics: dict = {"weights_match": out.weights_digest == ref.weights_digest,
                     "weights_digest": out.weights_digest}
    if not metrics["weights_match"]:
        failures.append("initial weights differ from the baseline's (same seed should give the same weights)")
    metrics["logits"] = _tensor_metrics(out.logits, ref.logits)
    agreement = top1_agreement(out.logits, ref.logits)
    if agreement is not None:
        metrics["top1_agreement"] = agreement
    if _exceeds(metrics["logits"]["rel_l2"], tolerance["logits_rel"]):
        failures.append(f"logits rel L2 {_fmt(metrics['logits']['rel_l2'])} > {tolerance['logits_rel']:g}")
    loss_diff = abs(out.loss - ref.loss)
    metrics["loss"] = {"value": out.loss, "reference": ref.loss, "abs_diff": loss_diff}
    if _exceeds(loss_diff, tolerance["loss_atol"]):
        failures.append(f"loss diff {_fmt(loss_diff)} > {tolerance['loss_atol']:g}")
    metrics["grads"] = {}
    for name, g_ref in ref.grads.items():
        g = out.grads.get(name)
        if g is None or g_ref is None:
            metrics["grads"][name] = {"max_abs": None, "rel_l2": None, "missing": True}
            failures.append(f"no gradient for {name}")
            continue
        m = _tensor_metrics(g, g_ref)
        metrics["grads"][name] = m
        if _exceeds(m["rel_l2"], tolerance["grad_rel"]):
            failures.append(f"grad {name} rel L2 {_fmt(m['rel_l2'])} > {tolerance['grad_rel']:g}")
    if out.heldout_logits is not None and ref.heldout_logits is not None:
        metrics["heldout"] = heldout_metrics(out.heldout_logits, ref.heldout_logits, ref.heldout_labels)
        failures += heldout_failures(metrics["heldout"], tolerance)
    if is_reference:
        return GateResult("REFERENCE", tolerance, metrics, "; ".join(failures) or None)
    return GateResult("FAIL" if failures else "PASS", tolerance, metrics, "; ".join(failures) or None)


def heldout_metrics(logits: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor) -> dict:
    """A stage's figures on the held-out images against the baseline's: accuracy (percent) of both, the
    drop in points, top-1 agreement and the logits' relative L2 error."""
    accuracy = 100.0 * (logits.argmax(-1) == labels).double().mean().item()
    reference = 100.0 * (ref.argmax(-1) == labels).double().mean().item()
    return {"images": int(labels.numel()), "accuracy_pct": accuracy, "reference_accuracy_pct": reference,
            "accuracy_drop_pts": reference - accuracy, "top1_agreement": top1_agreement(logits, ref),
            "logits_rel": _tensor_metrics(logits, ref)["rel_l2"]}


def heldout_failures(m: dict, tolerance: dict) -> list[str]:
    """Why the held-out figures fail the tolerances the recipe sets (accuracy_drop, top1_agreement)."""
    failures = []
    if "accuracy_drop" in tolerance and _exceeds(m["accuracy_drop_pts"], tolerance["accuracy_drop"]):
        failures.append(f"held-out accuracy {m['accuracy_pct']:.2f}% is {m['accuracy_drop_pts']:.2f} points below "
                        f"the baseline's {m['reference_accuracy_pct']:.2f}% (> {tolerance['accuracy_drop']:g})")
    if "top1_agreement" in tolerance and (m["top1_agreement"] is None
                                          or not m["top1_agreement"] >= tolerance["top1_agreement"]):
        failures.append(f"held-out top-1 agreement {_fmt(m['top1_agreement'])} < {tolerance['top1_agreement']:g}")
    return failures


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"

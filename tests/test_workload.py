"""The workload runner, precision resolution, timing and range marking, on the CPU with the tiny Swin."""
import pytest
from pathlib import Path

import torch

from workbench.errors import UserError
from workbench.models import TINY_MODEL, build_model, check_model_name, input_size
from workbench.precision import resolve_precision
from workbench.optimize.ranges import RangeMarker, annotate_modules
from workbench.optimize.timing import StepTiming, time_steps
from workbench.optimize.workload import Workload, WorkloadConfig
from workbench.devices import pick_device, resolve_device


def tiny(**kw):
    cfg = dict(model=TINY_MODEL, device="cpu", batch=2, precision="fp32")
    cfg.update(kw)
    return Workload.build(WorkloadConfig(**cfg))


def test_same_seed_same_weights_and_batch():
    a, b = tiny(), tiny()
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert a.x.shape == (2, *input_size(a.model))


def test_train_step_updates_weights_and_infer_does_not():
    w = tiny()
    before = w.model.head.fc.weight.detach().clone()
    loss = w.step(0)
    assert torch.isfinite(loss)
    assert not torch.equal(before, w.model.head.fc.weight)
    w = tiny(mode="infer")
    before = w.model.head.fc.weight.detach().clone()
    w.step(0)
    assert torch.equal(before, w.model.head.fc.weight)


def test_bf16_autocast_on_cpu_runs():
    w = tiny(precision="bf16")
    assert w.precision.amp_dtype is torch.bfloat16
    assert torch.isfinite(w.step(0))


def test_torch_ranges_appear_in_profiler():
    w = tiny()
    w.marker = RangeMarker("torch")
    handles = annotate_modules(w.model, w.marker)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        w.step(0)
    names = {e.name for e in prof.events()}
    for expected in ("step0", "forward", "backward", "optimizer", "stage0.block1", "attention", "mlp", "head"):
        assert expected in names
    for h in handles:
        h.remove()


def test_time_steps_counts_and_summarises():
    calls = []
    t = time_steps(calls.append, warmup=2, repeats=5, device=torch.device("cpu"))
    assert calls == list(range(7)) and len(t.samples_ms) == 5 and t.clock == "host"
    s = StepTiming([1.0, 2.0, 3.0, 4.0, 100.0], 0, "host")
    assert s.median_ms == 3.0 and s.iqr_ms == 2.0


@pytest.mark.parametrize("bad, message", [
    (dict(mode="eval"), "unknown mode"),
    (dict(batch=0), "--batch"),
])
def test_bad_config_is_a_user_error(bad, message):
    with pytest.raises(UserError, match=message):
        WorkloadConfig(model=TINY_MODEL, **bad)


def test_names_and_devices_are_checked():
    with pytest.raises(UserError, match="unknown precision"):
        resolve_precision("fp8")
    with pytest.raises(UserError, match="not a timm Swin"):
        check_model_name("resnet50")
    with pytest.raises(UserError, match="not a timm Swin"):
        build_model("swin_gigantic_patch4")
    with pytest.raises(UserError, match="unknown device"):
        resolve_device("tpu:0:x")
    if not torch.cuda.is_available():
        assert pick_device("auto") == "cpu"
        with pytest.raises(UserError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_per_call_us_rotates_inputs_and_counts_warm_calls():
    from workbench.optimize.timing import per_call_us

    calls = {"a": 0, "b": 0}

    def make(key):
        def fn():
            calls[key] += 1
        return fn

    med, p20, p80 = per_call_us([make("a"), make("b")], loops=3, calls=4)
    assert calls == {"a": 1 + 3 * 2, "b": 1 + 3 * 2}  # one warm call each, then round robin
    assert p20 <= med <= p80 and med >= 0


def test_environment_stamp_names_device_versions_and_commit():
    from workbench.env import device_label, environment_stamp

    stamp = environment_stamp("cpu")
    assert stamp["device_type"] == "cpu" and stamp["gpu"] is None and stamp["torch"] == torch.__version__
    assert stamp["swinbench"] is None or len(stamp["swinbench"].split("+")[0]) >= 7
    assert "no GPU" in device_label(stamp)


def test_source_digest_follows_the_code_not_the_commit(tmp_path):
    """The digest names the code that ran: stable for the same files, different when one changes."""
    import shutil

    import workbench.env as env

    root = tmp_path / "copy"
    shutil.copytree(Path(env.__file__).resolve().parent, root / "workbench",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "cli.py").write_text("# cli\n")
    (root / "recipes").mkdir()
    first = env.source_digest(root)
    assert first == env.source_digest(root) and len(first) == 12
    (root / "recipes" / "mine.yaml").write_text("name: mine\nextends: amp\n")
    assert env.source_digest(root) != first

"""What an output calls its device and the things it timed, read from the data, never assumed.

A trace captured on the CPU (Kineto without GPU kernels: its meta says `device: cpu`, and its kernel
tables hold leaf CPU operators) and a record whose `env.device_type` is `cpu` are labelled CPU and
"operators" / "op time"; everything else GPU and "kernels" / "kernel time". `trace_words` and
`record_words` give the words; the renderers of analyze, diff, profile, report and check use them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceWords:
    """The words for one kind of run: device 'CPU' | 'GPU'; unit / units: what the tables rank
    ('operator(s)' | 'kernel(s)'); op: short form for column heads ('op' | 'kernel'); time: what their
    durations add up to ('CPU op time' | 'GPU kernel time'); calls: how they are counted ('calls' |
    'launches')."""

    device: str
    unit: str
    units: str
    op: str
    time: str
    calls: str

    @property
    def is_cpu(self) -> bool:
        return self.device == "CPU"


GPU_WORDS = DeviceWords("GPU", "kernel", "kernels", "kernel", "GPU kernel time", "launches")
CPU_WORDS = DeviceWords("CPU", "operator", "operators", "op", "CPU op time", "calls")
MIXED_WORDS = DeviceWords("CPU/GPU", "operator/kernel", "operators/kernels", "op/kernel",
                          "CPU op / GPU kernel time", "calls/launches")


def trace_words(meta: dict) -> DeviceWords:
    """The words for an analyzed trace, from its meta (`device` is 'cpu' for a CPU-only capture)."""
    return CPU_WORDS if (meta or {}).get("device") == "cpu" else GPU_WORDS


def pair_words(meta_a: dict, meta_b: dict) -> DeviceWords:
    """The words for two traces compared with each other: MIXED_WORDS when one is CPU and one GPU."""
    a, b = trace_words(meta_a), trace_words(meta_b)
    return a if a == b else MIXED_WORDS


def _device_type(record) -> str | None:
    env = record.get("env") if isinstance(record, dict) else getattr(record, "env", None)
    if isinstance(env, dict):
        return env.get("device_type")
    return getattr(env, "device_type", None)


def record_words(records) -> DeviceWords:
    """The words for stage records (StageRecords, or dicts as apply holds them): CPU when every record's
    env says it ran on another device than CUDA (`device_type: cpu`), MIXED_WORDS when some did and some
    ran on CUDA, else GPU."""
    types = {_device_type(r) for r in records} - {None}
    if not types - {"cuda"}:
        return GPU_WORDS
    return MIXED_WORDS if "cuda" in types else CPU_WORDS

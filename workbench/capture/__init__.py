"""Capture: running a workload under Nsight Systems or torch.profiler, and the profile command."""

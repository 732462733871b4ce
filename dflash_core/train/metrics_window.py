"""Per-step metrics kept on the device and brought to the host once per log window."""

from __future__ import annotations

import torch


def to_host(metrics: dict) -> dict:
    """{name: float, or a list for a vector} in one copy per device (one sync, not one per metric);
    values that are not tensors pass through."""
    host = dict(metrics)
    by_device: dict[torch.device, list[str]] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(name)
    for names in by_device.values():
        flat = torch.cat([metrics[name].detach().reshape(-1).double() for name in names]).tolist()
        start = 0
        for name in names:
            count = metrics[name].numel()
            host[name] = flat[start:start + count] if count > 1 else flat[start]
            start += count
    return host


class MetricsWindow:
    """Running sums of the per-step metric tensors on their device (no host sync until `pop`)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for name, value in metrics.items():
            value = value.detach().float()
            self.sums[name] = self.sums[name] + value if name in self.sums else value.clone()
        self.steps += 1

    def pop(self) -> dict[str, torch.Tensor]:
        """{name: mean over the window} plus {"steps": n}; starts a new window."""
        if not self.steps:
            return {}
        means = {name: total / self.steps for name, total in self.sums.items()}
        means["steps"] = torch.tensor(float(self.steps))
        self.sums, self.steps = {}, 0
        return means

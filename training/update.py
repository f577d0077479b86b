"""The parameter update in the compiled graph: clipping, the non-finite guard and AdamW as one `torch.compile` call.

The eager update is `clip_grad_norm_`, the guard's tensor ops and the fused AdamW kernels, each launched from Python
(on an H100, 45 launch calls a compiled D2CSE step; docs/gpu.md). `InGraphUpdate` traces the same three as one graph
(`fullgraph=True`), so under `mode="reduce-overhead"` they replay as a CUDA graph after the step's own:

- clipping: the global gradient norm (`torch.nn.utils.clip_grad_norm_`'s formula: the 2-norm of the per-tensor
  2-norms, coefficient `max_norm / (norm + 1e-6)` clamped to 1), applied to the gradient as AdamW reads it (the
  stored `.grad` is left unscaled; the next step sets it to None anyway);
- the guard (`NonFiniteGuard.observe`): a tensor op; while its flag is set every update is an identity selected by
  `torch.where`, not skipped by a host branch, so nothing is read on the host;
- AdamW: torch's update rule (decoupled weight decay, bias corrections from the step count), on the optimizer's own
  state tensors (`exp_avg`, `exp_avg_sq`, `step`: the fused optimizer's layout, so resume states and the eager path
  read them unchanged), at the learning rate of the trainer's linear decay computed from the step tensor in the graph
  (`max(0, 1 - phase_step / horizon)` × the group's initial rate; the scheduler still steps on the host for logging
  and resume). Equal to the eager fused update within float rounding (tests/training/test_speed.py).

Used by the trainer's compiled path only (`LoopConfig.compile` and `compile_update`, with the guard: no fp16
GradScaler); the default CPU path is the eager update, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


def linear_decay(step: int, horizon: int) -> float:
    """The trainer's learning-rate factor at in-phase step `step`: linear decay to 0 over `horizon` steps."""
    return max(0.0, 1.0 - step / horizon)


def observe_non_finite(
    flag: Tensor, first_step: Tensor, first_values: Tensor, step: Tensor | int, values: Tensor
) -> None:
    """The non-finite guard's update, in place on the device (no host read): when `values`' first (the loss) or last
    (the gradient norm) entry is not finite, `flag` goes to 1 and stays there; the first such step and its values are
    kept in `first_step` / `first_values`.

    Args:
        flag: the guard's sticky flag (0-d float32).
        first_step: the first bad step of these metric names (0-d int64; -1 while none).
        first_values: that step's values (like `values`).
        step: this step (1-based; an int or a 0-d tensor).
        values: the step's loss, its terms and the gradient norm.
    """
    bad = ~(torch.isfinite(values[0]) & torch.isfinite(values[-1]))
    newly = bad & (flag == 0)
    first_step.copy_(torch.where(newly, step, first_step))
    first_values.copy_(torch.where(newly, values, first_values))
    flag.copy_(torch.maximum(flag, bad.to(flag.dtype)))


def adam_state(optimizer: torch.optim.Optimizer) -> list[list[tuple[Tensor, Tensor, Tensor]]]:
    """Per group, per parameter: its (`step`, `exp_avg`, `exp_avg_sq`), made where the optimizer has none yet in the
    fused AdamW's layout (a 0-d float32 step on the parameter's device, zero moments)."""
    groups = []
    for group in optimizer.param_groups:
        states = []
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states.append((st["step"], st["exp_avg"], st["exp_avg_sq"]))
        groups.append(states)
    return groups


class InGraphUpdate:
    """Clipping, the non-finite guard and AdamW of one phase as one compiled graph (module docstring).

    Args:
        optimizer: the phase's `torch.optim.AdamW` (its groups' `initial_lr`, betas, eps, weight decay; amsgrad off).
        max_norm: the clipping threshold.
        offset: the phase's first global step (the in-phase step of global step s is s - offset).
        horizon: the linear decay's length in steps.
        backend: `torch.compile`'s backend (the compiled step's).
        mode: its mode (the compiled step's; None for dynamo's own backends).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        offset: int,
        horizon: int,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
    ):
        if any(g.get("amsgrad") for g in optimizer.param_groups):
            raise ValueError("the in-graph AdamW has no amsgrad")
        self.optimizer, self.max_norm, self.offset, self.horizon = optimizer, max_norm, offset, horizon
        # (constants of the graph: reading the groups inside it would guard on their `lr`, which the scheduler changes)
        self.hyper = [(g["initial_lr"], *g["betas"], g["eps"], g["weight_decay"]) for g in optimizer.param_groups]
        self.graph = torch.compile(self.update, fullgraph=True, dynamic=False, backend=backend, mode=mode)

    def __call__(self, terms: Sequence[Tensor], step: Tensor, guard: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """Update the parameters once (`optimizer.step()` is not called; the scheduler steps as before).

        Args:
            terms: the step's loss and its loss terms (0-d tensors on the device).
            step: the 0-based global step (a 0-d int64 tensor, the trainer's step tensor).
            guard: the `NonFiniteGuard`'s flag and its (first step, first values) of these terms.

        Returns:
            The step's loss, terms and gradient norm, float32 (a graph output: copy it before the next call).
        """
        params = [[p for p in g["params"]] for g in self.optimizer.param_groups]
        grads = [[p.grad for p in ps] for ps in params]
        states = adam_state(self.optimizer)
        if step.device.type == "cuda":  # CUDA graphs mutate these in place at fixed addresses
            for t in (*guard, *(t for g in states for s in g for t in s)):
                if not hasattr(t, "_dynamo_static_input_type"):  # (marked once; a resumed state's new tensors too)
                    torch._dynamo.mark_static_address(t)
        values = self.graph(params, grads, states, list(terms), step, guard)
        setattr(self.optimizer, "_opt_called", True)  # noqa: B010 - the scheduler's check that the optimizer stepped
        return values

    def update(
        self,
        params: list[list[Tensor]],
        grads: list[list[Tensor]],
        states: list[list[tuple[Tensor, Tensor, Tensor]]],
        terms: list[Tensor],
        step: Tensor,
        guard: tuple[Tensor, Tensor, Tensor],
    ) -> Tensor:
        """The traced body: norm and clip, the guard, AdamW under `torch.where(ok, new, old)`."""
        flat = [g for gs in grads for g in gs]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in flat]), 2.0)
        coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        values = torch.stack([t.detach().float().reshape(()) for t in (*terms, norm)])
        flag, first_step, first_values = guard
        observe_non_finite(flag, first_step, first_values, step + 1, values)
        ok = flag == 0
        factor = torch.clamp(1.0 - (step - self.offset).float() / self.horizon, min=0.0)
        with torch.no_grad():
            for (initial_lr, b1, b2, eps, decay), ps, gs, sts in zip(self.hyper, params, grads, states):
                lr = factor * initial_lr
                for p, g, (count, m, v) in zip(ps, gs, sts):
                    g = g * coef
                    count_new = count + 1
                    m_new = torch.lerp(m, g, 1 - b1)
                    v_new = v * b2 + (1 - b2) * g * g
                    p_new = p * (1 - lr * decay) if decay else p
                    denom = v_new.sqrt() / (1 - b2**count_new).sqrt() + eps
                    p_new = p_new - (lr / (1 - b1**count_new)) * m_new / denom
                    p.copy_(torch.where(ok, p_new, p))
                    m.copy_(torch.where(ok, m_new, m))
                    v.copy_(torch.where(ok, v_new, v))
                    count.copy_(torch.where(ok, count_new, count))
        return values

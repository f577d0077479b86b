"""The suite's rule for comparing floating-point results that are equal up to summation order.

Two computations of the same mathematical value in float32 (a prefix that hides nothing against the plain model, a
chunked backward against a whole one, one CPU's SIMD width against another's) sum the same terms in another order.
Each rounding moves a partial sum by at most half an ulp of its own magnitude, so the difference scales with the
size of the values being summed, not with the element compared: a gradient entry of 0.6 that is the difference of
partial sums near 237 can differ by 1.5e-5 (seen on an Intel Xeon, where the AMD EPYC machines differed less).
A fixed `atol` of 1e-6 therefore passes or fails by CPU model.

The rule (docs/tests.md): `atol = ulps · eps(dtype) · sqrt(terms) · max|expected|`, i.e. a few units in the last
place of the largest value of the reference, grown with the square root of the number of terms summed into one
entry (round-off of a sum of n terms grows like sqrt(n) for independent roundings); `rtol` stays small, so an
entry far from zero is still checked to its own precision. The floor (`ulps` = 8, `terms` = 1) is 9.5e-7 × the
reference's largest magnitude in float32.

Examples:
    >>> import torch
    >>> from tests.tolerance import assert_close_scaled
    >>> ref = torch.tensor([237.0, 0.6])
    >>> assert_close_scaled(ref + torch.tensor([0.0, 1.5e-5]), ref)  # within a few ulps of 237
"""

from __future__ import annotations

import math

import torch

ULPS = 8.0


def scaled_atol(expected: torch.Tensor, terms: int = 1, ulps: float = ULPS, scale: float | None = None) -> float:
    """The absolute tolerance of the rule for `expected`.

    Args:
        expected: the reference values (a floating-point tensor).
        terms: how many terms are summed into one entry (e.g. a gradient summed over a batch of rows and positions);
            the tolerance grows with its square root.
        ulps: units in the last place of the reference's largest magnitude.
        scale: the magnitude of the values summed, when the reference itself is a cancellation (e.g. the gradient of
            a key bias, zero in exact arithmetic: pass the largest gradient of the model); default `max|expected|`.

    Returns:
        The tolerance (0.0 for an all-zero or empty reference without `scale`).
    """
    if scale is None:
        scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    return ulps * torch.finfo(expected.dtype).eps * math.sqrt(max(terms, 1)) * scale


def assert_close_scaled(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    terms: int = 1,
    ulps: float = ULPS,
    rtol: float = 1e-5,
    scale: float | None = None,
    msg=None,
) -> None:
    """`torch.testing.assert_close` with `atol` from `scaled_atol(expected, terms, ulps)`.

    Args:
        actual: the computed tensor.
        expected: the reference tensor (its largest magnitude sets the scale).
        terms: terms summed into one entry (see `scaled_atol`).
        ulps: units in the last place of the reference's largest magnitude.
        rtol: the relative tolerance per entry.
        scale: the magnitude of the summed values, when it is not the reference's own (see `scaled_atol`).
        msg: passed to `assert_close` (a string or a callable of the default message).
    """
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=scaled_atol(expected, terms, ulps, scale), msg=msg)

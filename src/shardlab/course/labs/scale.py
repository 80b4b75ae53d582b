"""Naming a result that is right up to a constant factor: the SUM not divided, divided twice, or
divided by a hard-coded 4 instead of the world size (seen on 3 ranks)."""

from __future__ import annotations

import torch

from shardlab.course.labs.tasks import Hint

STRONGER = ("the collective SUMs over ranks and never divides: find the one place you divide, "
            "and make it exactly one division by world_size")


def ratio(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """c when ``got`` == c x ``want`` (to float precision), else None."""
    got, want = got.detach().reshape(-1).double(), want.detach().reshape(-1).double()
    if got.shape != want.shape or not want.abs().sum():
        return None
    c = float(got @ want / (want @ want))
    return c if torch.allclose(got, c * want, rtol=1e-4, atol=1e-6) else None


def judge_scale(got: torch.Tensor, want: torch.Tensor, n: int, what: str) -> None:
    """Raise the Hint naming the factor by which ``got`` misses ``want`` (if it is one we know)."""
    c = ratio(got, want)
    if c is None or abs(c - 1) < 1e-3:
        return
    if abs(c - n) < 1e-3 * n and n > 1:
        raise Hint(f"{what} is {n}x too large: the collective SUMs over {n} ranks, and you did not divide the SUM by world_size", STRONGER,
                   mistake="not_divided")
    if abs(c - 1 / n) < 1e-3 and n > 1:
        raise Hint(f"{what} is {n}x too small: did you divide twice?", STRONGER, mistake="divided_twice")
    if n != 4 and abs(c - n / 4) < 1e-3:
        raise Hint(f"on {n} ranks {what} is {n}/4 of the mean: you divided by 4, not by world_size",
                   "divide by the world_size argument (or dist.get_world_size()), never a fixed number",
                   mistake="hard_coded_world_size")
    if abs(c) < 1e-6:
        raise Hint(f"{what} is all zeros", mistake="zeros")

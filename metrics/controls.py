"""Random-dimension controls of an intervention: their mean and spread, and the empirical p-value of the observed
effect against them.

    summary = control_summary(observed, controls)    # observed [...], controls [N, ...] -> {"mean", "sd", "p_value"}
    empirical_p_value(observed, controls)            # (1 + #{controls with |effect| >= |observed|}) / (N + 1)

The p-value counts the observed effect as one more draw from the controls' distribution (Davison & Hinkley 1997,
eq. 4.11; North, Curtis & Sham 2002), so it is never 0: its smallest value with N controls is 1 / (N + 1), 0.091
with 10. It is two-sided, by absolute size: a control at least as large either way counts. A nan effect (a layer
without a value) gets a nan p-value. `sd` is the sample standard deviation (N - 1), nan below 2 controls.
"""

from __future__ import annotations

import torch
from torch import Tensor


def empirical_p_value(observed: Tensor, controls: Tensor) -> Tensor:
    """observed [...], controls [N, ...] -> [...]: (1 + #{|control| >= |observed|}) / (N + 1), nan where observed is."""
    observed, controls = observed.double(), controls.double()
    extreme = (controls.abs() >= observed.abs()).sum(0).double()
    p = (1 + extreme) / (controls.shape[0] + 1)
    return torch.where(observed.isnan(), torch.full_like(p, float("nan")), p)


def control_summary(observed: Tensor, controls: Tensor) -> dict[str, Tensor]:
    """{"mean", "sd", "p_value"} of the controls' effects [N, ...] against the observed effect [...]."""
    controls = controls.double()
    sd = controls.std(0) if controls.shape[0] > 1 else torch.full(controls.shape[1:], float("nan"),
                                                                   dtype=torch.float64)
    return {"mean": controls.mean(0), "sd": sd, "p_value": empirical_p_value(observed, controls)}

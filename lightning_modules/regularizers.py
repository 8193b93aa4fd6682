"""Isotropy regularisers, one option group for fine-tuning and MLM pretraining: I-STAR and CosReg.

    python train.py fit --config configs/finetune/classify.yaml --data.source F --model.regularizer istar \\
        --model.reg_weight -1                          # away from isotropy (Rudman & Eickhoff's better direction)
    python train.py fit --config configs/pretrain/tiny.yaml --model.regularizer istar --model.reg_weight 0.5

    reg = Regularizer("istar", weight=1.0, layers="all", zeta=0.2)
    reg.bind(num_layers=6)                    # reg.layers == [1, ..., 6]: the embedding output (0) excluded
    term, value = reg([hidden[l] for l in reg.layers], mask)   # weight (1 - IsoScore*), IsoScore*: differentiable
    reg.refresh(encode, batches, hidden_size) # C0 over up to `shrinkage_tokens` training tokens, synced over ranks

- I-STAR (Rudman & Eickhoff, "Stable Anisotropic Regularization", ICLR 2024): term = weight (1 - IsoScore*(H)),
  H the token states of the chosen layers (their union: every token contributes one point per layer; padding never
  counts), IsoScore* of H's sample covariance shrunk as (1 - zeta) C_batch + zeta C0 (metrics/isotropy.py's
  isoscore_star_of_covariance, the formula isoscore_star uses), C0 the covariance of the same layers' states over up to
  `shrinkage_tokens` training tokens, recomputed at the start of every epoch by the training module (eval mode, no
  gradient; streamed with metrics.geometry.Covariance). weight > 0 pushes towards isotropy, < 0 away from it.
  Layers default to all transformer layers (1..L).
- CosReg (Gao et al., "Representation Degeneration Problem in Training Natural Language Generation Models", ICLR
  2019; the baseline of Rudman & Eickhoff): term = weight x R_cos of the chosen layers' token states, R_cos = 1/N^2
  sum_i sum_j cos(h_i, h_j), the mean of the N x N cosine matrix, its diagonal included, as Gao et al. define it
  (metrics/geometry.py's cosine_matrix_mean; averaged over the layers when several are chosen; the I-STAR authors'
  baseline, I-STAR/regularizers.py, takes the diagonal's N out of the sum and still divides by N^2: 1/N lower, the
  same gradient). Default: the last layer.

The batch statistic is the micro-batch's over every rank (gathered): each rank's moments (token count, sum, centred
outer products; for CosReg the sum of unit vectors) are summed over ranks with a differentiable all-reduce, so every rank
computes the same value and a 2-process run equals one process with the same global batch, gradients included (DDP's
averaging of the all-reduced gradient gives the single-process one). The moments are masked sums (no boolean
indexing): nothing here waits for the device.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from core.errors import UserError
from metrics.geometry import Covariance, cosine_matrix_mean
from metrics.isotropy import isoscore_star_of_covariance

REGULARIZERS = ("none", "istar", "cosreg")
STATISTICS = {"istar": "isoscore_star", "cosreg": "mean_cosine"}  # what train/<name> logs beside train/reg_loss
DEFAULT_LAYERS = {"istar": "all", "cosreg": "last"}


class Regularizer:
    """A regulariser's settings, its shrinkage covariance C0 (I-STAR) and its differentiable term (see the module
    docstring). Bad settings are one line (UserError); a weight of 0 with a regulariser warns (computed and logged,
    no effect on the loss)."""

    def __init__(self, name: str = "none", weight: float = 0.0, layers: str | int | list[int] | None = None,
                 zeta: float = 0.2, shrinkage_tokens: int = 250_000) -> None:
        if name not in REGULARIZERS:
            raise UserError(f"--model.regularizer must be one of {', '.join(REGULARIZERS)}, got {name!r}")
        if not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise UserError(f"--model.reg_weight must be a finite number, got {weight}")
        if not isinstance(zeta, (int, float)) or not 0 <= zeta <= 1:
            raise UserError(f"--model.zeta must lie in [0, 1], got {zeta}")
        if not isinstance(shrinkage_tokens, int) or shrinkage_tokens < 2:
            raise UserError(f"--model.reg_shrinkage_tokens must be at least 2, got {shrinkage_tokens}")
        self.name, self.weight, self.zeta, self.shrinkage_tokens = name, float(weight), float(zeta), shrinkage_tokens
        self.requested = parse_layers(layers)
        self.layers: list[int] = []
        self.shrinkage: Tensor | None = None  # C0 [hidden, hidden] float64 (I-STAR with zeta > 0)
        self.shrinkage_epoch: int | None = None  # the epoch C0 was computed for
        self.shrinkage_tokens_used = 0  # the tokens C0 was computed from, over every rank
        if name != "none" and weight == 0:
            warnings.warn(f"--model.regularizer {name} with --model.reg_weight 0 does not change the loss: its "
                          f"{STATISTICS[name]} is computed and logged only (λ > 0 pushes towards isotropy, λ < 0 away)",
                          stacklevel=2)
        elif name == "none" and weight != 0:
            warnings.warn(f"--model.reg_weight {weight:g} is ignored without a regulariser (--model.regularizer istar "
                          "or cosreg)", stacklevel=2)

    @property
    def on(self) -> bool:
        return self.name != "none"

    @property
    def statistic(self) -> str:
        return STATISTICS[self.name]

    @property
    def needs_shrinkage(self) -> bool:
        return self.name == "istar" and self.zeta > 0

    def bind(self, num_layers: int) -> list[int]:
        """The chosen hidden-state layers of a model with `num_layers` transformer layers (0 = the embedding output,
        allowed when named), checked."""
        if not self.on:
            return []
        spec = self.requested if self.requested is not None else DEFAULT_LAYERS[self.name]
        if spec == "all":
            layers = list(range(1, num_layers + 1))
        elif spec == "last":
            layers = [num_layers]
        else:
            bad = [layer for layer in spec if not 0 <= layer <= num_layers]
            if bad:
                raise UserError(f"--model.reg_layers {','.join(map(str, spec))}: layer(s) {bad} are outside the "
                                f"model's layers 0..{num_layers} (0 = embedding output)")
            layers = sorted(set(spec))
        self.layers = layers
        return layers

    # -- the term --

    def __call__(self, states: list[Tensor], mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """(weight x the penalty, the statistic) of the chosen layers' states [batch, seq, hidden] (mask [batch, seq]:
        the tokens that count; None: all), over every rank's micro-batch together. In float32 (float64 states stay
        float64) whatever the autocast around it."""
        with torch.autocast(states[0].device.type, enabled=False):
            points = [(state if state.dtype == torch.float64 else state.float()).reshape(-1, state.shape[-1])
                      for state in states]  # [points, hidden] per layer
            w = None if mask is None else mask.reshape(-1, 1).to(points[0].dtype)  # [points, 1], 0 or 1
            if self.name == "istar":
                value = self._isoscore_star(points, w)
                return self.weight * (1 - value), value.detach()
            value = self._mean_cosine(points, w)
            return self.weight * value, value.detach()

    def _isoscore_star(self, layers: list[Tensor], w: Tensor | None) -> Tensor:
        """IsoScore* of the union of the layers' points [points, hidden] (w: each point's weight, 0 or 1; None: all
        count) over every rank: the count, sum x and sum x x^T are summed in float64 over layers and ranks, as
        metrics.geometry.Covariance sums them (each layer centred on its own mean in float32 first, then shifted back
        exactly, so a dimension whose mean dwarfs its spread keeps its variance)."""
        hidden = layers[0].shape[-1]
        n = (w.sum() if w is not None else torch.tensor(float(layers[0].shape[0]), device=layers[0].device)).double()
        total, outer = 0, 0
        for x in layers:
            shift = ((x if w is None else w * x).sum(0) / n.to(x.dtype).clamp_min(1)).detach()  # a constant shift
            centred = x - shift
            weighted = centred if w is None else w * centred
            first, second, shift = weighted.sum(0).double(), (weighted.T @ centred).double(), shift.double()
            total = total + first + n * shift
            outer = outer + second + first.unsqueeze(1) * shift + shift.unsqueeze(1) * first + \
                n * shift.unsqueeze(1) * shift
        count = n * len(layers)
        sums = all_reduce(torch.cat([count.view(1), total, outer.flatten()]))
        count, mean, outer = sums[0], sums[1:1 + hidden] / sums[0], sums[1 + hidden:].view(hidden, hidden)
        cov = (outer - count * mean.unsqueeze(1) * mean) / (count - 1).clamp_min(1)  # unbiased, as isoscore_star's
        if self.shrinkage is not None and self.shrinkage.device != cov.device:
            # once: a resumed C0 is restored before Lightning moves the model (on the CPU), and copying it from the
            # host at every step would wait for the device each time
            self.shrinkage = self.shrinkage.to(cov.device)
        return isoscore_star_of_covariance(cov, self.zeta, self.shrinkage)

    def _mean_cosine(self, layers: list[Tensor], w: Tensor | None) -> Tensor:
        """CosReg's R_cos of each layer's points (w as above) over every rank, averaged over the layers: the mean of
        their N x N cosine matrix, diagonal included (metrics.geometry.cosine_matrix_mean)."""
        rows = []
        for x in layers:
            units = F.normalize(x, dim=-1)  # a zero vector stays zero (cosine 0, as metrics.geometry.cosine)
            units = units if w is None else units * w
            count = w.sum() if w is not None else torch.tensor(float(x.shape[0]), device=x.device)
            rows.append(torch.cat([units.sum(0), count.to(units.dtype).view(1)]))
        sums = all_reduce(torch.stack(rows).double())  # [layers, hidden + 1]
        return cosine_matrix_mean(sums[:, :-1], sums[:, -1]).mean()

    # -- the shrinkage covariance C0 --

    @torch.no_grad()
    def refresh(self, encode: Callable[[dict], tuple[list[Tensor], Tensor | None]], batches: Iterable[dict],
                hidden_size: int, device: torch.device, epoch: int) -> None:
        """C0 = the covariance of the chosen layers' states (union) over `batches` (this rank's share of up to
        `shrinkage_tokens` training tokens; `encode(batch)` gives the chosen layers' states and the token mask),
        synced over ranks."""
        metric = Covariance(1, hidden_size).to(device)
        metric.update(torch.zeros(1, 0, hidden_size, device=device))  # a rank with no batch still takes part
        for batch in batches:
            states, mask = encode(batch)
            x = torch.stack(states)  # [layers, batch, seq, hidden]
            tokens = x[:, mask] if mask is not None else x.flatten(1, 2)
            metric.update(tokens.reshape(1, -1, hidden_size))
        result = metric.compute()
        self.shrinkage, self.shrinkage_epoch = result.cov[0], epoch
        self.shrinkage_tokens_used = result.num_tokens // max(len(self.layers), 1)  # tokens (each one point a layer)

    def state_dict(self) -> dict:
        return {"shrinkage": None if self.shrinkage is None else self.shrinkage.cpu(), "epoch": self.shrinkage_epoch,
                "name": self.name, "layers": list(self.layers)}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """A checkpoint's C0, kept when it is of this regulariser's layers (another setting recomputes it)."""
        if state.get("shrinkage") is not None and state.get("name") == self.name and \
                list(state.get("layers") or []) == self.layers:
            self.shrinkage, self.shrinkage_epoch = state["shrinkage"].to(device), state.get("epoch")


def parse_layers(spec) -> str | list[int] | None:
    """`all`, `last`, a layer, `1,3,5`, or a list of layers (YAML); None: the regulariser's default."""
    if spec is None or spec in ("all", "last"):
        return spec
    if isinstance(spec, bool):
        raise UserError(f"--model.reg_layers must be all, last or layers such as 4 or 1,3,5, got {spec}")
    if isinstance(spec, int):
        return [spec]
    if isinstance(spec, str):
        parts = [part.strip() for part in spec.strip("[] ").split(",") if part.strip()]
        if parts and all(part.lstrip("-").isdigit() for part in parts):
            return [int(part) for part in parts]
    elif isinstance(spec, (list, tuple)) and spec and all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
        return list(spec)
    raise UserError(f"--model.reg_layers must be all, last or layers such as 4 or 1,3,5, got {spec!r}")


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def all_reduce(tensor: Tensor) -> Tensor:
    """The sum over ranks, differentiable (its backward all-reduces the gradient); the tensor itself on one process."""
    if not is_distributed():
        return tensor
    from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

    return differentiable_all_reduce(tensor)

"""The variants every evaluation reports side by side: raw, clipped, and a post-hoc normalisation.

    spec = parse_clip("auto").resolve(outliers, num_layers=7, hidden_size=384)   # {layer: dims}: --clip
    parse_clip("auto").rule(num_layers=7)            # which rule that was, and why: the reports' clip_rule
    variants = [RAW, Clipping(spec, num_layers=7), whitening(cov.compute())]
    vectors = variant.apply(vectors)                 # [layers, ..., hidden] -> a new tensor, same shape
    mean, cov = variant.moments(mean, cov)           # the exact moments of the transformed tokens
    states = SoftDecay(-0.2).states(hidden_states, mask)   # per sentence: [layers, batch, seq, hidden], before picking

- Clipping zeroes dimensions per layer (`zero_dims`, the one way this project zeroes dimensions: analyses,
  classifiers and callbacks alike), applied to hidden states after the forward pass. Which ones is --clip's choice
  (`parse_clip`, the same option everywhere): by default (`auto`) the paper's two choices, told apart by a depth
  threshold of ours: for base-depth models (at most BASE_DEPTH = 12 transformer layers, as the paper's §4 clips its
  base models) the persistent outlier dims (an outlier in at least half of layers 1..L: our number) in every
  non-input layer, for deeper ones (as Appendix D clips its large models, whose outliers move across layer ranges,
  e.g. BERT-large's) each layer's own outliers in that layer; `per-layer` that second rule whatever the depth; given dims; or an explicit
  per-layer form such as 1-10:896,10-17:678. `ClipRequest.rule(num_layers)` says which rule applied and why.
- Whitening (Su, Cao, Liu & Ou, "Whitening Sentence Representations for Better Semantics and Faster Retrieval",
  2021): x -> (x - mu) U Lambda^{-1/2}, with mu and the covariance U Lambda U^T estimated per layer from the vectors
  the protocol compares (token vectors; for STS, as in the paper, mean-pooled sentence embeddings); what is
  constant up to float32 rounding is dropped (mapped to 0): a dimension by standardisation's rule (below), then a
  principal direction v whose variance is at most 1e-5 x v^T diag(C) v, the variance of the dimensions it lives on
  (e.g. LayerNorm's null direction). Never relative to the largest direction: a massive activation's variance, 1e5
  times the others', would drop genuine ordinary directions.
- Standardisation (Timkey & van Schijndel, "All Bark and No Bite: Rogue Dimensions in Transformer Language Models
  Obscure Representational Quality", EMNLP 2021): x -> (x - mu) / sigma per dimension; a dimension constant up to
  float32 rounding (e.g. a last-layer LayerNorm weight near 0) is mapped to 0, as dividing by its rounding noise
  would swamp every cosine. The test is per dimension, never against the layer's largest variance (a rogue
  dimension's can be 1e8 times the others'): sigma <= 1e-6 × max(|mu|, 1). A float32 value of magnitude |mu| is
  known to |mu| × 2^-24 (6e-8), and a hidden state has been rounded a few times on its way (LayerNorm's sums), so a
  spread under ~17 such roundings is noise; the 1 is the scale of the LayerNorm-normalised values every dimension
  is made from, whose rounding reaches a dimension whose mean is near 0 too.
Both normalisations are affine per layer, so they commute with averaging sub-word pieces and mean pooling.
- SoftDecay (Yan, Gui, Li & He, "Addressing Token Uniformity in Transformers via Singular Value Transformation",
  UAI 2022, tokenUni) is not a map of single vectors: per sentence and layer it transforms the singular values of the
  sentence's token matrix H = U S V^T (padding excluded), s' = -log(1 - alpha (s + alpha)) / alpha with alpha < 0,
  rescaled so that max s' = max s, and H' = U S' V^T. A variant like it is `per_sentence`: protocols take its word
  pieces, tokens and pooled sentences from `states(hidden_states, mask)` of each batch instead of the raw states
  (analyses/reference.py `views`), and `apply` is the identity. The map is tokenUni's; applying it post hoc, at a
  fixed alpha, to each sentence's token matrix at every layer of a frozen encoder is ours (tokenUni learn alpha with
  the map inside the last layer, before its LayerNorm: lightning_modules/softdecay.py; docs/analyses.md says why).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from core.defaults import NORMALIZATIONS, SOFTDECAY_ALPHA  # noqa: F401  (--normalize's choices, the alpha's default)
from core.errors import UserError
from metrics.geometry import CovarianceResult
from metrics.isotropy import eigh, svd
from metrics.outliers import LayerOutliers, persistent_dims

REPORT_KEYS = {"whiten": "whitened", "standardize": "standardized"}  # the fitted normalisations' variant keys
BASE_DEPTH = 12  # --clip auto (a threshold of ours): persistent dims up to this many layers (§4), each layer's beyond


class Variant:
    """The identity: raw hidden states."""

    key = "raw"
    per_sentence = False  # True: transforms each sentence's token matrix (`states`) before vectors are picked

    def states(self, hidden_states: Tensor, mask: Tensor) -> Tensor:
        """The hidden states [layers, batch, seq, hidden] of a batch (mask [batch, seq]: the tokens that count) as
        this variant's protocols pick from them: themselves, unless the variant is `per_sentence`."""
        return hidden_states

    def apply(self, vectors: Tensor) -> Tensor:
        return vectors

    def moments(self, mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
        """mean [layers, hidden], cov [layers, hidden, hidden] of x -> those of the transformed x."""
        return mean, cov


RAW = Variant()


def keep_mask(dims: Mapping[int, Sequence[int]], num_layers: int, hidden_size: int) -> Tensor:
    """[layers, hidden] float: 0 on the dimensions `dims` ({layer: dims}, 0-indexed) names in each layer, 1 elsewhere."""
    keep = torch.ones(num_layers, hidden_size)
    for layer, chosen in dims.items():
        keep[layer, list(chosen)] = 0
    return keep


def zero_dims(vectors: Tensor, keep: Tensor) -> Tensor:
    """vectors [layers, ..., hidden] with the dimensions where keep [layers, hidden] is 0 zeroed (a new tensor;
    differentiable)."""
    shape = (keep.shape[0],) + (1,) * (vectors.dim() - 2) + (keep.shape[1],)
    return vectors * keep.to(device=vectors.device, dtype=vectors.dtype).view(shape)


def clip_spec(clip: Sequence[int] | Mapping[int, Sequence[int]] | None, num_layers: int, hidden_size: int
              ) -> dict[int, list[int]]:
    """A clip spec → {layer: sorted dims}; a plain sequence applies to every layer. Checks the ranges."""
    if clip is None:
        return {}
    if isinstance(clip, Mapping):
        spec = {int(layer): sorted({int(d) for d in dims}) for layer, dims in clip.items()}
    else:
        dims = sorted({int(d) for d in clip})
        spec = {layer: dims for layer in range(num_layers)} if dims else {}
    for layer, dims in spec.items():
        if not 0 <= layer < num_layers:
            raise UserError(f"--clip layer {layer} is outside the model's layers 0..{num_layers - 1}")
        bad = [d for d in dims if not 0 <= d < hidden_size]
        if bad:
            raise UserError(f"--clip dimensions {bad} are outside the model's dimensions 0..{hidden_size - 1}")
    return {layer: dims for layer, dims in spec.items() if dims}


CLIP_MODES = ("auto", "per-layer", "none")


@dataclass(frozen=True)
class ClipRequest:
    """What --clip asks for, before it meets a model and its outliers (see `parse_clip`)."""

    text: str  # as given, for the report
    mode: str  # "auto" | "per-layer" | "none" | "dims" (every non-input layer) | "layers" (explicit per layer)
    dims: tuple[int, ...] = ()
    layers: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (layer, dims) for mode "layers"
    notes: tuple[str, ...] = ()  # what parsing merged, to be said
    origin: str | None = None  # for a spec resolved earlier and passed on as layers (analyze.py paper): its rule

    @property
    def needs_outliers(self) -> bool:
        return self.mode in ("auto", "per-layer")

    def persistent(self, num_layers: int) -> bool:
        """Whether "auto" takes the persistent dims for a model with `num_layers` hidden states (L = num_layers - 1
        transformer layers): at base depth, L <= BASE_DEPTH."""
        return self.mode == "auto" and num_layers - 1 <= BASE_DEPTH

    def rule(self, num_layers: int) -> str:
        """Which rule `resolve` applies to a model with `num_layers` hidden states, and why (the report's clip_rule)."""
        depth = num_layers - 1
        if self.origin is not None:
            return self.origin
        if self.mode == "auto" and self.persistent(num_layers):
            return (f"auto: persistent outlier dims (outliers in at least half of layers 1..{depth}, a number of ours: "
                    f"the paper gives none) zeroed in every non-input layer, as the paper's §4 clips its base models "
                    f"({depth} <= {BASE_DEPTH} layers, a threshold of ours: the paper names no depth)")
        if self.mode == "auto":
            return (f"auto: each non-input layer's own outlier dims zeroed in that layer only, as the paper's Appendix D "
                    f"clips its large models, whose outliers move across layer ranges ({depth} > {BASE_DEPTH} layers, "
                    "a threshold of ours: the paper names no depth)")
        if self.mode == "per-layer":
            return "per-layer (as asked): each non-input layer's own outlier dims zeroed in that layer only"
        if self.mode == "dims":
            return "given dims (as asked), zeroed in every non-input layer"
        if self.mode == "layers":
            return "given per-layer dims (as asked), zeroed in the layers named"
        return "none: nothing zeroed"

    def resolve(self, outliers: Sequence[LayerOutliers] | None, num_layers: int, hidden_size: int
                ) -> dict[int, list[int]]:
        """{layer: dims} to zero, for a model with `num_layers` hidden states (0 = the embedding output) and the
        outliers detected on the data (needed by "auto" and "per-layer"). "auto": at base depth (<= BASE_DEPTH
        transformer layers) the persistent dims in every non-input layer (§4), deeper each non-input layer's own
        outliers in that layer (Appendix D; `rule` says which); "per-layer": the latter at any depth; given dims:
        every non-input layer; the explicit form: the layers it names."""
        upper = range(1, num_layers)
        if self.mode == "none":
            return {}
        if self.needs_outliers:
            if outliers is None:
                raise ValueError(f"--clip {self.text} needs the outliers detected on the data")
            if self.persistent(num_layers):
                spec = clip_spec(dict.fromkeys(upper, persistent_dims(list(outliers))), num_layers, hidden_size)
            else:
                spec = clip_spec({layer.layer: layer.outlier_dims for layer in outliers if layer.layer >= 1},
                                 num_layers, hidden_size)
        else:
            spec = clip_spec(dict.fromkeys(upper, self.dims) if self.mode == "dims" else dict(self.layers), num_layers,
                             hidden_size)
        full = [layer for layer, dims in spec.items() if len(dims) == hidden_size]
        if full:  # zero vectors: every clipped cosine, spectrum and classifier would be 0/0, not a measurement
            raise UserError(f"--clip {self.text} zeroes all {hidden_size} dims of layer {full[0]}"
                            + (" (the outlier rule flags every one)" if self.needs_outliers else "")
                            + ": nothing is left to compare; use --clip none or fewer dims")
        return spec


def parse_clip(text: str) -> ClipRequest:
    """--clip: auto | per-layer | none | d1,d2,... (those dims in every non-input layer) | an explicit per-layer form
    L1-L2:d1+d2,L3:d3,... (layer ranges inclusive; dims of one item joined by '+'). Overlapping ranges that name
    other dims for the same layer are merged (the union), and a note says so. Syntax only: ranges are checked
    against the model by ClipRequest.resolve."""
    raw = str(text).strip()
    lowered = raw.lower()
    if lowered in CLIP_MODES:
        return ClipRequest(raw, lowered)
    if not raw:
        raise UserError("--clip is empty: give auto, per-layer, none, dims (557 or 77,588) or layers:dims (1-10:896)")
    items = [item.strip() for item in raw.split(",")]
    if any(":" in item for item in items):
        return _parse_per_layer(raw, items)
    try:
        dims = tuple(sorted({int(item) for item in items}))
    except ValueError:
        raise UserError(f"--clip must be auto, per-layer, none, dims (557 or 77,588) or layers:dims "
                        f"(1-10:896,10-17:678), got {raw!r}") from None
    if any(d < 0 for d in dims):
        raise UserError(f"--clip dimensions must be 0 or more, got {raw!r}")
    return ClipRequest(raw, "dims", dims=dims)


def _parse_per_layer(raw: str, items: list[str]) -> ClipRequest:
    chosen: dict[int, set[int]] = {}
    named: dict[int, str] = {}  # layer -> the item that first named it
    notes = []
    for item in items:
        layers_text, _, dims_text = item.partition(":")
        if ":" not in item or not layers_text.strip() or not dims_text.strip():
            raise UserError(f"--clip item {item!r} is empty: each item is LAYERS:DIMS, e.g. 1-10:896 or 3:77+588")
        try:
            first, _, last = layers_text.strip().partition("-")
            start, stop = int(first), int(last or first)
            dims = {int(d) for d in dims_text.split("+")}
        except ValueError:
            raise UserError(f"--clip item {item!r} is not LAYERS:DIMS (e.g. 1-10:896 or 3:77+588)") from None
        if start < 0 or stop < start or any(d < 0 for d in dims):
            raise UserError(f"--clip item {item!r}: layers run low-high and dimensions are 0 or more")
        for layer in range(start, stop + 1):
            if layer in chosen and chosen[layer] != dims:
                notes.append(f"layer {layer} is in {named[layer]!r} and {item!r}: its dims are merged")
            chosen.setdefault(layer, set()).update(dims)
            named.setdefault(layer, item)
    layers = tuple((layer, tuple(sorted(dims))) for layer, dims in sorted(chosen.items()))
    return ClipRequest(raw, "layers", layers=layers, notes=tuple(dict.fromkeys(notes)))


def clipped_dims(spec: Mapping[int, Sequence[int]]) -> list[int]:
    """The union of the dims a {layer: dims} spec zeroes."""
    return sorted({int(d) for dims in spec.values() for d in dims})


def per_layer_report(spec: Mapping[int, Sequence[int]]) -> dict[str, list[int]]:
    """{"<layer>": [dims]} for a report (JSON keys are strings)."""
    return {str(layer): sorted(int(d) for d in dims) for layer, dims in sorted(spec.items())}


class Clipping(Variant):
    """Zero dimensions per layer: `spec` {layer: dims} (0-indexed), or a plain list of dims for every layer."""

    key = "clipped"

    def __init__(self, spec: Sequence[int] | Mapping[int, Sequence[int]], num_layers: int) -> None:
        if not isinstance(spec, Mapping):
            spec = dict.fromkeys(range(num_layers), spec)
        self.spec = {int(layer): sorted({int(d) for d in dims}) for layer, dims in spec.items() if len(dims)}
        self.dims = clipped_dims(self.spec)
        self.num_layers = num_layers

    def keep(self, hidden_size: int) -> Tensor:
        return keep_mask(self.spec, self.num_layers, hidden_size)

    def apply(self, vectors: Tensor) -> Tensor:
        return zero_dims(vectors, self.keep(vectors.shape[-1]))

    def moments(self, mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
        keep = self.keep(mean.shape[-1]).to(mean)  # [layers, hidden]
        return mean * keep, cov * keep.unsqueeze(2) * keep.unsqueeze(1)


class Affine(Variant):
    """x -> (x - shift) @ matrix per layer; shift [layers, hidden], matrix [layers, hidden, hidden]."""

    def __init__(self, key: str, shift: Tensor, matrix: Tensor) -> None:
        self.key, self.shift, self.matrix = key, shift.double(), matrix.double()

    def apply(self, vectors: Tensor) -> Tensor:
        layers, hidden = self.shift.shape
        flat = vectors.reshape(layers, -1, hidden).double()
        shift, matrix = self.shift.to(flat.device), self.matrix.to(flat.device)
        out = torch.bmm(flat - shift.unsqueeze(1), matrix)
        return out.to(vectors.dtype).reshape(vectors.shape)

    def moments(self, mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
        matrix = self.matrix.to(cov)
        new_mean = torch.bmm((mean - self.shift.to(mean)).unsqueeze(1), matrix).squeeze(1)
        return new_mean, matrix.transpose(1, 2) @ cov @ matrix


def whitening(stats: CovarianceResult, tolerance: float = 1e-6, direction_tolerance: float = 1e-5) -> Affine:
    """Su et al. (2021) whitening from per-layer statistics (of tokens or sentence embeddings): the transformed
    vectors have identity covariance (on the directions that carry variance).

    Rounding, not the largest direction, sets what is dropped (mapped to 0), as for `standardization`: first each
    dimension constant up to float32 rounding (standardization's rule, `tolerance`), then each principal direction v
    whose variance is at most `direction_tolerance` x v^T diag(C) v, the variance its dimensions would give it
    uncorrelated: the float32 rounding of the streamed covariance is relative to the dimensions a direction lives on,
    and puts LayerNorm's null direction, or a rank-deficient fit's, at 1e-8 to 5e-7 of it (30 x below 1e-5 at
    768 dims and 8192 tokens a batch). A massive activation's variance (Sun et al. 2024: ~1e5 times the others') then
    drops none of the ordinary directions, as a floor of 1e-6 of the largest eigenvalue did."""
    cov = stats.cov.double()
    variance, varies = dimension_variances(stats, tolerance)
    matrix = torch.zeros_like(cov)  # columns of the dropped directions (and of constant dims) stay 0
    for layer in range(cov.shape[0]):  # the eigenproblem of the dims that vary: sizes differ by layer
        dims = varies[layer].nonzero().flatten()
        eigenvalues, vectors = eigh(cov[layer][dims][:, dims])  # ascending
        own = vectors.pow(2).mul(variance[layer, dims].unsqueeze(1)).sum(0)  # v_k^T diag(C) v_k
        scale = torch.where(eigenvalues > direction_tolerance * own, eigenvalues.clamp_min(1e-300).rsqrt(),
                            torch.zeros_like(eigenvalues))
        matrix[layer, dims, :len(dims)] = vectors * scale
    return Affine("whitened", stats.mean, matrix)


def dimension_variances(stats: CovarianceResult, tolerance: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Each dimension's variance [layers, hidden] (float64) and whether it varies: a dimension constant up to float32
    rounding, sigma <= `tolerance` x max(|mu|, 1) (each dimension on its own; see the module docstring), does not.
    The rule standardisation and whitening share."""
    variance = torch.diagonal(stats.cov.double(), dim1=1, dim2=2).clamp_min(0)
    return variance, variance > (tolerance * stats.mean.double().abs().clamp_min(1.0)) ** 2


def standardization(stats: CovarianceResult, tolerance: float = 1e-6) -> Affine:
    """Timkey & van Schijndel (2021) per-dimension z-scores from per-layer statistics (of tokens or sentences);
    a dimension constant up to float32 rounding (`dimension_variances`) -> 0."""
    variance, varies = dimension_variances(stats, tolerance)
    scale = torch.where(varies, variance.clamp_min(1e-300).rsqrt(), torch.zeros_like(variance))
    return Affine("standardized", stats.mean, torch.diag_embed(scale))


def normalization(name: str, stats: CovarianceResult | None, fit: str = "tokens") -> Variant | None:
    """A fitted --normalize variant (whiten, standardize; "none" -> None), built from the statistics of the vectors
    it is fit on: token vectors (`fit="tokens"`) or mean-pooled sentence embeddings (`fit="sentences"`, STS).
    SoftDecay is fit on nothing: `SoftDecay(alpha)`."""
    if name not in REPORT_KEYS:
        return None
    if stats is None or stats.num_tokens < 2:
        found = 0 if stats is None else stats.num_tokens
        raise UserError(f"--normalize {name} needs statistics of at least 2 {fit}, got {found}")
    return whitening(stats) if name == "whiten" else standardization(stats)


def check_softdecay_alpha(alpha: float, option: str = "--softdecay_alpha") -> float:
    """alpha in (-1, 0), or one line naming `option`: SoftDecay needs alpha < 0, and at alpha <= -1 the logarithm's
    argument 1 - alpha (s + alpha) is not positive for small singular values s."""
    if not (isinstance(alpha, (int, float)) and -1 < alpha < 0):
        raise UserError(f"{option} must lie in (-1, 0) (SoftDecay needs alpha < 0, and alpha <= -1 takes the log of "
                        f"a non-positive number for small singular values), got {alpha}")
    return float(alpha)


def soft_decay(hidden_states: Tensor, mask: Tensor, alpha: float | Tensor) -> Tensor:
    """tokenUni's SoftDecay per sentence and layer: hidden_states [layers, batch, seq, hidden] (or [batch, seq,
    hidden]), mask [batch, seq] (the tokens of each sentence's matrix; padding never) -> the same shape, each
    sentence's counted rows replaced by U S' V^T, the others left as they are.

    s' = -log(1 - alpha (s + alpha)) / alpha (alpha in (-1, 0): a concave, increasing map that lifts the small
    singular values against the large), rescaled so that max s' = max s. Singular values at rounding level (below
    max s x max(seq, hidden) x float32 epsilon, the rank rule of torch.linalg.matrix_rank) have no direction of
    their own (their singular vectors are arbitrary): they stay 0, so the matrix keeps its rank and padded rows stay
    out. alpha -> 0- is the identity. Computed in float32 (the map of the singular values in float64). Differentiable
    in the states and in alpha (a 0-dim tensor: the fine-tuning layer of lightning_modules/softdecay.py, which calls
    it one unpadded sentence at a time, as SVD gradients are undefined for repeated singular values)."""
    mask = mask.to(hidden_states.device).bool()
    x = hidden_states.float() * mask.unsqueeze(-1)
    u, s, vh = svd(x)
    s64 = s.double()
    top = s64[..., :1]
    significant = s64 > top * max(x.shape[-2:]) * torch.finfo(torch.float32).eps
    alpha = alpha.double() if isinstance(alpha, Tensor) else alpha
    mapped = torch.where(significant, -torch.log1p(-alpha * (s64 + alpha)) / alpha, torch.zeros_like(s64))
    peak = mapped[..., :1]  # the map is increasing: the largest stays first
    scaled = torch.where(peak > 0, mapped * top / peak.clamp_min(1e-300), s64)  # a matrix of norm < |alpha|: as is
    out = (u * scaled.to(u.dtype).unsqueeze(-2)) @ vh
    return torch.where(mask.unsqueeze(-1), out.to(hidden_states.dtype), hidden_states)


class SoftDecay(Variant):
    """tokenUni's SoftDecay (see soft_decay): a per-sentence transformation of the singular values, `alpha` < 0."""

    key = "softdecay"
    per_sentence = True

    def __init__(self, alpha: float = SOFTDECAY_ALPHA) -> None:
        self.alpha = check_softdecay_alpha(alpha)

    def states(self, hidden_states: Tensor, mask: Tensor) -> Tensor:
        return soft_decay(hidden_states, mask, self.alpha)

    def moments(self, mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
        raise TypeError("SoftDecay is no map of single vectors: its moments are those of its own transformed tokens")

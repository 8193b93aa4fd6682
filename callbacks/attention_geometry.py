"""Live query / key geometry of self-attention during MLM pretraining (Godey et al. 2024), logged to W&B (or any
Lightning logger).

    python train.py fit --config configs/pretrain/tiny.yaml           # on in every pretraining config
    # its cadence: every_n_steps / image_every_n_steps in the config's trainer.callbacks

Every `every_n_steps` optimizer steps, from that step's own forward pass (all its micro-batches on every rank; no
extra pass: see callbacks/live.py), and over the whole validation set at each validation, per transformer layer
l = 1..L (each head's vectors, averaged over the heads; metrics/attention.py), a summary section and the per-layer
detail below it (W&B groups panels by the key's first component; callbacks/live.py):

    attention/<statistic>                              each statistic below, mean over the watched layers
    attention/over_steps                               image: each statistic per layer against the step
    attention_by_layer/layer_{l}/qk_mean_cosine        cosine between the mean query and the mean key
    attention_by_layer/layer_{l}/query_mean_norm_ratio norm of the mean query over the mean query norm (common drift)
    attention_by_layer/layer_{l}/key_mean_norm_ratio   the same for keys
    attention_by_layer/layer_{l}/query_anisotropy, key_anisotropy   mean cosine of `pairs_per_sequence` random
                                                       position pairs of one sequence (drawn per step from `seed`)
    attention_by_layer/layer_{l}/entropy               mean attention entropy of `queries_per_sequence` random query
                                                       positions of every sequence, over its keys, / log(keys)
                                                       (of softmax(q k^T / sqrt(d)): with clipped softmax or gated
                                                       attention, the softmax before clipping or gating)
    attention_by_layer/num_tokens

and, unless `sinks` is false, the attention sinks of Gu et al. (ICLR 2025; metrics/sinks.py) of every sequence's
attention softmax(q k^T / sqrt(d)) over its keys, each query's row averaged over the sequence's tokens:

    sinks/sink_share, first_token_mass                  mean over layers 1..L of the per-layer values below
    sinks_by_layer/layer_{l}/sink_share                 share of (sequence, head) whose first token gets more than
                                                        `sink_epsilon` (0.3) of the attention
    sinks_by_layer/layer_{l}/first_token_mass           mean attention on the first token
    sinks_by_layer/layer_{l}/special_token_mass         mean attention on special tokens: those of the training data's
                                                        tokenizer (trainer.datamodule.tokenizer; core.tokenizers.sink_ids,
                                                        as analyze.py outliers: added special tokens too, not [UNK] or
                                                        the pad), else the config's bos / eos / cls / sep ids; logged
                                                        when the batch holds input_ids and there are any

which ids, and from where, is recorded as each logger's hyperparameters (sinks/special_token_ids,
sinks/special_tokens, sinks/special_tokens_from: W&B's config, CSV's hparams.yaml).

(`val_attention/...`, `val_sinks/...` for validation, at the step of `val/loss`.) No forward hook (they are skipped
once the model is compiled): layer l's queries and keys are recomputed from the layer's input, the hidden state l - 1
the model returns through its tap (core.capture.HiddenStateTap), with the layer's own query and key projections: a
projection of the states the forward made, not a forward. The training step's projection weights are copied when its
capture starts (the optimizer updates them before the batch ends), so the queries and keys are those of the step's
forward. A model whose attention is not a projection of its hidden states (core.models.attention_projections: pre-LN
models) is refused at setup with one line. The pretraining arms (lightning_modules/arms.py): a causal arm's entropy
is over the keys a query sees (its own position and those before it); the rotary arm's entropy takes queries and keys
rotated as its attention rotates them (core.families.rotary_queries_keys), its other statistics the projections
before the rotation; the sinks take the attention the arm computes (causal, rotated). Statistics sync across ranks
(sum states): a step's values equal one process's on the same global batch.
W&B and TensorBoard also get the image every `image_every_n_steps` and at each validation; CSV gets the scalars.
"""

from __future__ import annotations

import torch
from torch import Tensor

from callbacks import wandb_logging as logs
from callbacks.live import Captured, LiveCallback, by_layer, layer_metrics
from callbacks.media import FIGURES
from callbacks.outlier_statistics import pair_positions, pair_seed
from core.errors import UserError
from core.families import is_causal, rotary_queries_keys
from core.models import attention_projections, find_encoder
from core.step_figures import over_steps_figure
from core.tokenizers import sink_ids
from metrics.attention import NAMES, QueryKeyGeometry, project_heads
from metrics.sinks import EPSILON, AttentionSinks, attention_key_mass, token_kinds
from metrics.summary import over_layers

PREFIX = {"train": "attention", "val": "val_attention"}
SINKS = {"train": "sinks", "val": "val_sinks"}
TITLES = {"qk_mean_cosine": "cosine of mean query and mean key", "query_mean_norm_ratio": "|mean query| / mean |query|",
          "key_mean_norm_ratio": "|mean key| / mean |key|", "query_anisotropy": "query anisotropy (random pairs)",
          "key_anisotropy": "key anisotropy (random pairs)", "entropy": "attention entropy / log(length)"}


def sink_special_ids(trainer, config) -> tuple[list[int], dict]:
    """The ids whose attention is the sinks' special_token_mass, and the setting saying which they are and where they
    come from: the training data's tokenizer (`trainer.datamodule.tokenizer`) by the project's one rule
    (core.tokenizers.sink_ids, as `analyze.py outliers`: named and added special tokens, not [UNK], not the pad);
    without a tokenizer to reach, the model config's bos / eos / cls / sep ids, its pad left out (added special tokens
    then go uncounted)."""
    tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
    if tokenizer is not None:
        ids = sink_ids(tokenizer)
        return ids, {"sinks/special_token_ids": ids, "sinks/special_tokens": tokenizer.convert_ids_to_tokens(ids),
                     "sinks/special_tokens_from": "the training data's tokenizer: its special and added special tokens, "
                                                  "not [UNK] or the pad (core.tokenizers.sink_ids)"}
    pad = getattr(config, "pad_token_id", None)
    ids = sorted({i for i in (getattr(config, f"{name}_token_id", None) for name in ("bos", "eos", "cls", "sep"))
                  if i is not None and i != pad})
    return ids, {"sinks/special_token_ids": ids,
                 "sinks/special_tokens_from": "the model config's bos / eos / cls / sep ids, the pad left out: no "
                                              "tokenizer reachable (trainer.datamodule.tokenizer), so added special "
                                              "tokens are not counted"}


class AttentionGeometry(LiveCallback):
    """Per-layer query / key geometry and attention entropy of the training step every N steps and at validation.

    Args:
        every_n_steps: optimizer steps between two captures (step 0 included).
        image_every_n_steps: steps between two over-time figures (a multiple of every_n_steps; 0: only at
            validation).
        layers: transformer layers to watch, 1..L (default all; attention has none at the embedding output).
        pairs_per_sequence: random position pairs per sequence for the query and key anisotropy (64: a capture of 16
            sequences then varies by ~0.02 on a fixed model, 16 pairs gave ~0.04; docs/live-statistics.md#sampling).
        queries_per_sequence: random query positions per sequence whose attention entropy is taken.
        on_validation: also over the whole validation set at every validation.
        seed: draws the pairs and query positions (with the step).
        sinks: also the attention sinks (Gu et al. 2025): every query's attention, in chunks of 256 queries.
        sink_epsilon: a head of a sequence is a sink when its first token gets more than this (Gu et al.: 0.3).
    """

    def __init__(self, every_n_steps: int = 100, image_every_n_steps: int = 1000, layers: list[int] | None = None,
                 pairs_per_sequence: int = 64, queries_per_sequence: int = 64, on_validation: bool = True,
                 seed: int = 0, sinks: bool = True, sink_epsilon: float = EPSILON) -> None:
        super().__init__(every_n_steps, image_every_n_steps, layers, on_validation)
        self.pairs_per_sequence, self.queries_per_sequence, self.seed = pairs_per_sequence, queries_per_sequence, seed
        self.sinks, self.sink_epsilon = sinks, sink_epsilon
        self.sink_metrics: dict[str, AttentionSinks] = {}
        self.special_ids: list[int] = []
        self._special: Tensor | None = None  # special_ids as a tensor on the captured ids' device, made once
        self.attention_layers: list[int] = []
        self.projections: list = []  # (query Linear, key Linear, heads) of each watched layer
        self.history: list[list] = []  # [step, stage, layer, *NAMES values] per capture: the images; in checkpoints
        self.geometry: dict[str, QueryKeyGeometry] = {}
        self._weights: list | None = None  # the captured training step's projection weights
        self._weights_step: int | None = None
        self.causal, self.rotate = False, None  # a causal model's mask; a rotary model's rotation (q, k) -> (q, k)

    def check_settings(self) -> None:
        super().check_settings()
        for name in ("pairs_per_sequence", "queries_per_sequence"):
            if getattr(self, name) < 1:
                raise UserError(f"AttentionGeometry: {name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.sink_epsilon < 1:
            raise UserError(f"AttentionGeometry: sink_epsilon must lie in [0, 1), got {self.sink_epsilon}")

    def capture_layers(self, pl_module, available: int) -> list[int]:
        """The inputs of the watched transformer layers: hidden state l - 1 for layer l."""
        projections = attention_projections(pl_module)
        chosen = list(range(1, len(projections) + 1)) if self.requested_layers is None else list(self.requested_layers)
        if not chosen or len(set(chosen)) != len(chosen) or not all(1 <= layer <= len(projections) for layer in chosen):
            raise UserError(f"AttentionGeometry: layers {chosen} must be distinct transformer layers within "
                            f"1..{len(projections)} (attention has none at the embedding output)")
        self.attention_layers, self.projections = chosen, [projections[layer - 1] for layer in chosen]
        model = find_encoder(pl_module) or pl_module
        self.causal, self.rotate = is_causal(model.config), rotary_queries_keys(model)
        return [layer - 1 for layer in chosen]

    def build(self, trainer, pl_module) -> None:
        if self.geometry:
            return
        query, _, heads = self.projections[0]
        for stage in PREFIX:
            self.geometry[stage] = QueryKeyGeometry(len(self.attention_layers), heads,
                                                    query.out_features // heads).to(pl_module.device)
        logs.define_step_metrics(trainer, [f"{name}/*" for prefix in PREFIX.values()
                                           for name in (prefix, by_layer(prefix))])
        if self.sinks:
            self.special_ids, setting = sink_special_ids(trainer, find_encoder(pl_module).config)
            self._special = None
            logs.log_settings(trainer, setting)
            for stage in SINKS:
                self.sink_metrics[stage] = AttentionSinks(len(self.attention_layers), heads, self.sink_epsilon,
                                                          len(self.special_ids)).to(pl_module.device)
            logs.define_step_metrics(trainer, [f"{name}/*" for prefix in SINKS.values()
                                               for name in (prefix, by_layer(prefix))])

    def weights(self, copy: bool = True) -> list[tuple[Tensor, Tensor | None, Tensor, Tensor | None, int]]:
        """The projections' current weights, detached (copies unless `copy` is False): (query weight, bias, key
        weight, bias, heads)."""
        def detached(tensor):
            return None if tensor is None else tensor.detach().clone() if copy else tensor.detach()

        return [(detached(q.weight), detached(q.bias), detached(k.weight), detached(k.bias), heads)
                for q, k, heads in self.projections]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self.capture_step is not None and self._weights_step != self.capture_step:  # the step's first micro-batch
            self._weights, self._weights_step = self.weights(), self.capture_step

    def update(self, stage: str, captured: Captured, trainer, pl_module) -> None:
        hidden, mask = captured.hidden, captured.mask  # [watched layers' inputs, batch, seq, hidden], [batch, seq]
        geometry = self.geometry[stage]
        if geometry.device != hidden.device:
            geometry.to(hidden.device)
        # training: the weights of the step's forward (copied when it started); validation: the unchanging ones
        weights = self._weights if stage == "train" and self._weights is not None else self.weights(copy=False)
        seq = hidden.shape[2]
        key = pair_seed(self.seed, self.capture_step if stage == "train" else None)
        pairs = pair_positions(seq, self.pairs_per_sequence, key, hidden.device)
        rows = pair_positions(seq, self.queries_per_sequence, key + 1, hidden.device)[0]
        masses = []
        real = torch.ones(hidden.shape[1:3], dtype=torch.bool, device=hidden.device) if mask is None \
            else mask.to(hidden.device).bool()  # the sinks' counted queries and keys
        with torch.no_grad():
            for index, (query, query_bias, key_weight, key_bias, heads) in enumerate(weights):
                queries = project_heads(hidden[index], query.to(hidden.device),
                                        None if query_bias is None else query_bias.to(hidden.device), heads)
                keys = project_heads(hidden[index], key_weight.to(hidden.device),
                                     None if key_bias is None else key_bias.to(hidden.device), heads)
                attended = self.rotate(queries, keys) if self.rotate is not None else None
                geometry.update(index, queries, keys, mask, pairs, rows, self.causal, attended)
                if self.sink_metrics:
                    masses.append(attention_key_mass(*(attended or (queries, keys)), real, real, causal=self.causal))
            if masses:
                self.update_sinks(stage, torch.stack(masses), real, captured.input_ids)

    def update_sinks(self, stage: str, masses: Tensor, mask: Tensor, input_ids: Tensor | None) -> None:
        """masses [watched layers, batch, heads, seq] (metrics/sinks.py) with the special-token kind of each key."""
        metric = self.sink_metrics[stage]
        if metric.device != masses.device:
            metric.to(masses.device)
        kinds = None
        if input_ids is not None and self.special_ids:
            if self._special is None or self._special.device != input_ids.device:
                self._special = torch.tensor(self.special_ids, dtype=input_ids.dtype, device=input_ids.device)
            kinds = token_kinds(input_ids, self._special)
        metric.update(masses, mask, kinds)

    def finish_sinks(self, stage: str, trainer, step: int) -> None:
        """The sinks' scalars (every rank computes: the states sync; rank zero logs)."""
        metric = self.sink_metrics[stage]
        result = metric.compute()
        metric.reset()
        if not trainer.is_global_zero or not logs.real_loggers(trainer) or result["num_sequences"] == 0:
            return
        prefix, layers = SINKS[stage], self.attention_layers
        values = {name: result[name].cpu().tolist() for name in ("sink_share", "first_token_mass")}
        scalars = {f"{prefix}/{name}": over_layers(column, layers, "mean") for name, column in values.items()}
        if self.special_ids:
            values["special_token_mass"] = result["special_mass"].sum(-1).cpu().tolist()
        scalars.update(layer_metrics(prefix, layers, values))
        logs.log_scalars(trainer, scalars, step)

    def finish(self, stage: str, trainer, pl_module, step: int) -> None:
        if self.sink_metrics:
            self.finish_sinks(stage, trainer, step)
        geometry = self.geometry[stage]
        result = geometry.compute()  # every rank: the states sync here
        geometry.reset()
        if stage == "train":
            self._weights = None
        if not trainer.is_global_zero or not logs.real_loggers(trainer) or result["num_tokens"] == 0:
            return
        self.log_result(trainer, stage, step, result)

    def log_result(self, trainer, stage: str, step: int, result: dict) -> None:
        prefix = PREFIX[stage]
        values = {name: result[name].cpu().tolist() for name in NAMES}
        layers = self.attention_layers
        metrics = {f"{prefix}/{name}": over_layers(values[name], layers, "mean") for name in NAMES}
        metrics.update(layer_metrics(prefix, layers, values))
        metrics[f"{by_layer(prefix)}/num_tokens"] = float(result["num_tokens"])
        for i, layer in enumerate(layers):
            self.history.append([step, stage, layer, *(round(values[name][i], 6) for name in NAMES)])
        logs.log_scalars(trainer, metrics, step)
        if stage == "val" or self.due_images(step):  # drawn off the training thread (callbacks/media.py)
            rows, layers = [row for row in self.history if row[1] == stage], list(self.attention_layers)
            FIGURES.submit(trainer, f"{prefix}/over_steps", lambda: self.figure(stage, rows, layers), step)

    @staticmethod
    def figure(stage: str, rows: list[list], layers: list[int]):
        """Each statistic per layer against the step, from history rows of `stage`."""
        panels = []
        for column, name in enumerate(NAMES, 3):
            series = {f"layer {layer}": ([row[0] for row in rows if row[2] == layer],
                                         [row[column] for row in rows if row[2] == layer])
                      for layer in layers}
            panels.append({"title": TITLES[name], "ylabel": "", "series": series})
        over = "validations" if stage == "val" else "training steps"
        return over_steps_figure(panels, title=f"attention geometry per layer over {over} (Godey et al. 2024)")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self._weights = None

    def teardown(self, trainer, pl_module, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._weights = None

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict.get("history", []))

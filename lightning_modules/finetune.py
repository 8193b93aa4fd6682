"""Fine-tuning any BERT-family encoder for sentence (or sentence-pair) classification, every weight trained, with an
optional isotropy regulariser (I-STAR, CosReg: lightning_modules/regularizers.py).

    python train.py fit --config configs/finetune/classify.yaml --data.source labelled.csv     # the packaged MiniLM
    python train.py fit --config configs/finetune/sst2.yaml --model.encoder bert-base-uncased \\
        --model.regularizer istar --model.reg_weight -1 --trainer.default_root_dir runs/sst2-istar-minus1

`self.model` is transformers' AutoModelForSequenceClassification on the encoder (a hub id, a local directory, this
project's export or run directory, or a pretraining .ckpt), its classification head new (the classes the data
module found). The loss is the cross-entropy plus the regulariser's term on the chosen layers' token states (padding
excluded). At the end of fit, on every rank: the validation and test splits are evaluated with the final weights
(accuracy; per layer the IsoScore* of the test tokens: the mean over test batches of IsoScore* of the batch's tokens,
shrunk with --model.zeta towards the covariance of all test tokens, as `analyze.py isotropy` shrinks towards the
covariance of all tokens; the batches are the one-process batches of --data.eval_batch_size consecutive examples, each
whole on one rank, and metrics.isotropy.IsoScoreStar sums their scores over ranks: the same on any device count), then rank zero writes <default_root_dir>/export/ (transformers, `analyze.py --encoder` and
`probe.py --model.encoder` load it) and <default_root_dir>/finetune.json.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_only
from torch import Tensor
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from core.errors import UserError
from core.models import model_max_length, quiet_transformers
from core.output import export_weights, staged_output, write_json
from core.sources import cannot_load, hub_commit, pretrained
from lightning_modules.attention import install_recorded, load_pretrained
from lightning_modules.encoder import default_encoder, resolve_model_dir
from lightning_modules.loading import check_is_encoder, load_failure
from lightning_modules.softdecay import SoftDecayLayer, wrap
from lightning_modules.training import TrainingModule, check_optimisation, run_seed
from metrics.geometry import Covariance
from metrics.isotropy import IsoScoreStar
from metrics.transforms import SOFTDECAY_ALPHA

REPORT = "finetune.json"


def load_classifier(encoder: str, classes: list, seed: int = 0):
    """(AutoModelForSequenceClassification with a new head of len(classes), its tokenizer) from a hub id, a local
    directory or export, a run directory or a pretraining .ckpt; one line when it cannot be loaded. The new head
    (and any encoder weight the source lacks: a pooler) is drawn by `initialise_new` from `seed` alone, so a .ckpt
    and its export give the same head."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    source = resolve_model_dir(encoder)
    labels = {"num_labels": len(classes), "id2label": dict(enumerate(map(str, classes))),
              "label2id": {str(c): i for i, c in enumerate(classes)}}
    if source.endswith(".ckpt"):  # train.py's pretraining checkpoint: its encoder weights, embedded tokenizer
        from lightning_modules.checkpoints import load_checkpoint_model

        masked_lm, tokenizer = load_checkpoint_model(source)
        masked_lm.config.update(labels)
        model = install_recorded(AutoModelForSequenceClassification.from_config(masked_lm.config))
        model.base_model.load_state_dict(masked_lm.base_model.state_dict())
        base = {id(parameter) for parameter in model.base_model.parameters()}  # the MLM has no classifier head
        initialise_new(model, {name for name, parameter in model.named_parameters() if id(parameter) not in base}, seed)
        return model, tokenizer
    try:
        config = pretrained(AutoConfig, source)
    except (OSError, ValueError) as error:
        raise cannot_load("encoder", encoder, load_failure(error, 'its config')) from None
    check_is_encoder(config, encoder, weights_of=source)
    try:
        tokenizer = pretrained(AutoTokenizer, source)
    except Exception as error:
        raise cannot_load("encoder", encoder, load_failure(error, 'its tokenizer')) from None
    try:
        with quiet_transformers():  # the new head's "newly initialized" report is expected here
            # float32 weights whatever config.json records (a bfloat16 / float16 checkpoint loads in its own dtype
            # otherwise): the trainer's precision decides what the forward computes in, as for a .ckpt
            model, info = load_pretrained(AutoModelForSequenceClassification, source, **labels, dtype=torch.float32,
                                          ignore_mismatched_sizes=True, output_loading_info=True)
    except UserError:
        raise
    except Exception as error:
        raise cannot_load("encoder", encoder, load_failure(error, 'its weights')) from None
    missing = set(info.get("missing_keys", ())) | {key[0] for key in info.get("mismatched_keys", ())}
    initialise_new(model, missing, seed)
    return model, tokenizer


def initialise_new(model, missing: set[str], seed: int) -> None:
    """Draw the classifier's weights its source lacks (`missing`, named as in `model.named_parameters()`: the new
    head, a pooler; a fine-tuned source's head of the same size is kept, as transformers keeps it) from a generator of
    their own seeded with `seed`, in module order, as transformers' BERT init draws them (normal(0, initializer_range),
    biases 0, LayerNorms 1 and 0). from_config (a .ckpt) and from_pretrained (an export) consume the global generator
    differently, so without this one seed gave two heads."""
    generator = torch.Generator().manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for name, parameter in module.named_parameters(recurse=False):
                if f"{prefix}.{name}".lstrip(".") not in missing:
                    continue
                if isinstance(module, torch.nn.LayerNorm) or name == "bias":
                    parameter.fill_(1.0 if isinstance(module, torch.nn.LayerNorm) and name == "weight" else 0.0)
                else:
                    parameter.copy_(torch.empty(parameter.shape).normal_(0.0, std, generator=generator))


class FineTuneModule(TrainingModule):
    """AutoModelForSequenceClassification + AdamW with linear warm-up and decay; logs train/loss (and the
    regulariser's train/reg_loss, train/isoscore_star or train/mean_cosine), val/loss, val/accuracy.

    Args:
        encoder: hub id (org/name@REVISION pins one), local directory, this project's export or run directory, or a
            pretraining .ckpt (None: the packaged MiniLM).
        classes: the class names, in label order (linked from the data module by train.py).
        lr: AdamW's peak learning rate (fused AdamW where the device has the kernels).
        betas: AdamW's (beta1, beta2) (default (0.9, 0.999), transformers' and BERT's).
        eps: AdamW's epsilon.
        weight_decay: AdamW's decoupled weight decay.
        decay_bias_and_norm: True also decays biases and LayerNorm weights (default False: BERT's convention).
        warmup_steps: linear warm-up to `lr` over this many optimizer steps.
        decay_steps: the step at which the (1 - progress)^power decay reaches `end_lr` (default: the trainer's
            max_steps).
        end_lr: the learning rate at `decay_steps`.
        power: the decay's exponent (1: linear).
        dropout: hidden and attention dropout (None: the encoder's own, 0.1 for BERT-family checkpoints).
        regularizer: an isotropy regulariser on the training forward's hidden states: none (default), istar or
            cosreg (lightning_modules/regularizers.py; docs/finetuning.md).
        reg_weight: its weight λ in the loss (λ > 0 towards isotropy, λ < 0 away; 0 leaves the loss as it is).
        reg_layers: the hidden-state layers it acts on (default: every layer 1..L).
        zeta: I-STAR's shrinkage towards the covariance C0 of the epoch's first tokens; it also shrinks the report's
            IsoScore* of the test tokens.
        reg_shrinkage_tokens: tokens of that covariance C0.
        softdecay: tokenUni's SoftDecay as a layer in the last layer (lightning_modules/softdecay.py; off by default).
        softdecay_alpha: its alpha, starting in (-1, 0) (default -0.2); logged as train/softdecay_alpha and written
            to finetune.json.
        softdecay_alpha_mode: learned (default: tokenUni's unconstrained learnable alpha), bounded (ours: alpha =
            -sigmoid(theta), kept in (-1, 0)) or fixed (not learned).
        softdecay_placement: before_layernorm (default: as tokenUni place it, before the last layer's LayerNorm) or
            after_layernorm (ours: on the last layer's output).
    """

    def __init__(
        self,
        encoder: str | None = None,
        classes: list[str | int] | None = None,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        decay_bias_and_norm: bool = False,
        warmup_steps: int = 20,
        decay_steps: int | None = None,
        end_lr: float = 0.0,
        power: float = 1.0,
        dropout: float | None = None,
        regularizer: str = "none",
        reg_weight: float = 0.0,
        reg_layers: str | int | list[int] | None = None,
        zeta: float = 0.2,
        reg_shrinkage_tokens: int = 250_000,
        softdecay: bool = False,
        softdecay_alpha: float = SOFTDECAY_ALPHA,
        softdecay_alpha_mode: str = "learned",
        softdecay_placement: str = "before_layernorm",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_optimisation(self.hparams)
        if not classes or len(classes) < 2:
            raise UserError(f"fine-tuning needs at least two classes, got {classes}")
        self.make_regularizer()  # its options checked before the encoder loads
        layer = SoftDecayLayer(softdecay_alpha, softdecay_alpha_mode, softdecay_placement, dropout)  # checked even
        self.softdecay = layer if softdecay else None  # unused: a bad alpha, mode or placement is an error
        self.encoder_name = encoder or default_encoder()
        self.model, self.tokenizer = load_classifier(self.encoder_name, list(classes), run_seed())
        self.encoder_commit = hub_commit(self.encoder_name)  # the hub commit it was read at (None: a local path)
        self.model.train()  # from_pretrained leaves it in eval mode, which Lightning keeps: dropout would be off
        config = self.model.config
        if dropout is not None:
            for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout"):
                if hasattr(config, key):
                    setattr(config, key, dropout)
            for module in self.model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = dropout
        self.regularizer.bind(config.num_hidden_layers)
        if self.softdecay is not None:
            wrap(self.model, self.softdecay, repr(self.encoder_name))
        self.max_length = model_max_length(self.model, self.tokenizer)
        self.val_loss = MeanMetric()
        self.val_accuracy = MulticlassAccuracy(len(classes), average="micro")
        self.results: dict = {}

    # -- steps --

    def forward(self, batch: dict[str, Tensor], hidden_states: bool = False):
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "token_type_ids") if key in batch}
        if self.softdecay is None:
            return self.model(**inputs, output_hidden_states=hidden_states)
        self.softdecay.mask = batch["attention_mask"]  # read by the hook on the layer stack (softdecay.wrap)
        try:
            return self.model(**inputs, output_hidden_states=hidden_states)
        finally:
            self.softdecay.mask = None

    def optimized_parameters(self):
        """The model's parameters, and a learned SoftDecay alpha (0-dim: never weight-decayed)."""
        yield from self.model.named_parameters()
        if self.softdecay is not None:
            yield from (("softdecay." + name, parameter) for name, parameter in self.softdecay.named_parameters())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        tap = self.hidden_state_tap
        wanted = self.request_states()  # the regulariser's request (with the graph) and the callbacks', one forward
        try:
            out = self(batch, hidden_states=wanted)
            loss = F.cross_entropy(out.logits.float(), batch["labels"])
            if self.softdecay is not None:  # the alpha of this forward, logged as train/softdecay_alpha
                self.monitor.add_values({"softdecay_alpha": torch.as_tensor(self.softdecay.alpha, device=loss.device)})
        except BaseException:
            tap.release(self.regularizer)
            raise
        return self.regularized(loss, out.hidden_states if wanted else None, batch["attention_mask"].bool())

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        tap = self.hidden_state_tap
        out = self(batch, hidden_states=tap.active)
        if tap.active:
            tap.keep(out.hidden_states)
        self.val_loss.update(F.cross_entropy(out.logits.float(), batch["labels"]), len(batch["labels"]))
        self.val_accuracy.update(out.logits.argmax(-1), batch["labels"])

    def on_validation_epoch_end(self) -> None:
        loss, accuracy = self.val_loss.compute(), self.val_accuracy.compute()  # over every rank's examples
        self.val_loss.reset()
        self.val_accuracy.reset()
        self.log_dict({"val/loss": loss, "val/accuracy": accuracy}, prog_bar=True, sync_dist=True)

    def shrinkage_states(self, batch: dict) -> tuple[list[Tensor], Tensor | None]:
        """I-STAR's C0 pass: the regulariser's layers of a batch of training examples, padding excluded."""
        batch = {key: value.to(self.device) for key, value in batch.items()}
        states = self(batch, hidden_states=True).hidden_states
        return [states[layer] for layer in self.regularizer.layers], batch["attention_mask"].bool()

    # -- the end of fit: evaluation with the final weights, export, report --

    @torch.no_grad()
    def evaluate(self, loader, isotropy: bool) -> dict:
        """Accuracy over every rank's examples of `loader`; with `isotropy`, per layer the IsoScore* of the tokens
        (each batch's, shrunk with zeta towards the covariance of all of them: a first pass), averaged over every
        rank's batches (the data module deals whole batches to the ranks: the one-process batches)."""
        layers, hidden = self.model.config.num_hidden_layers + 1, self.model.config.hidden_size
        training = self.training
        self.eval()
        try:
            accuracy = MulticlassAccuracy(self.model.config.num_labels, average="micro").to(self.device)
            covariance = Covariance(layers, hidden).to(self.device)
            covariance.update(torch.zeros(layers, 0, hidden, device=self.device))  # a rank with no batch takes part
            for batch in loader if isotropy else ():
                batch = {key: value.to(self.device) for key, value in batch.items()}
                mask = batch["attention_mask"].bool()
                covariance.update(torch.stack(self(batch, hidden_states=True).hidden_states), mask)
            star = IsoScoreStar(layers, hidden, self.hparams.zeta, shrinkage=covariance.compute().cov).to(self.device)
            for batch in loader:
                batch = {key: value.to(self.device) for key, value in batch.items()}
                out = self(batch, hidden_states=isotropy)
                accuracy.update(out.logits.argmax(-1), batch["labels"])
                if isotropy:
                    star.update(torch.stack(out.hidden_states)[:, batch["attention_mask"].bool()])
            result = {"accuracy": float(accuracy.compute())}
            if isotropy:
                result["isoscore_star"] = star.compute().tolist()
            return result
        finally:
            self.train(training)

    def on_fit_end(self) -> None:
        trainer = self.trainer
        if self.monitor is not None:
            self.monitor.check(trainer.strategy)  # a run that ends past a non-finite step exports nothing
        data = trainer.datamodule
        val, test = self.evaluate(data.val_dataloader(), False), self.evaluate(data.test_dataloader(), True)
        self.results = {"val": val, "test": test, "steps": trainer.global_step}
        for logger in trainer.loggers if trainer.is_global_zero else ():
            logger.log_metrics({"val/final_accuracy": val["accuracy"], "test/accuracy": test["accuracy"],
                                **{f"test_by_layer/layer_{layer}/isoscore_star": value
                                   for layer, value in enumerate(test["isoscore_star"])}}, step=trainer.global_step)
        self.write_outputs(Path(trainer.default_root_dir), data)
        trainer.strategy.barrier("export")

    def report(self, data) -> dict:
        h, reg, results = self.hparams, self.regularizer, self.results
        return {
            "encoder": self.encoder_name, "encoder_commit": self.encoder_commit, "regularizer": h.regularizer,
            "reg_weight": h.reg_weight, "zeta": h.zeta,
            "reg_layers": reg.layers, "accuracy": results["test"]["accuracy"], "val_accuracy": results["val"]["accuracy"],
            "steps": results["steps"],
            "softdecay": self.softdecay is not None,
            **({"softdecay_alpha": self.softdecay.value(), "softdecay_alpha_initial": self.softdecay.initial,
                "softdecay_alpha_mode": self.softdecay.mode, "softdecay_placement": self.softdecay.placement}
               if self.softdecay is not None else {}),
            "layers": [{"layer": layer, "isoscore_star": value}
                       for layer, value in enumerate(results["test"]["isoscore_star"])],
            "classes": list(h.classes), "majority": data.majority(), "splits": data.described(),
            "isoscore_star_note": f"per layer (0 = embedding output), the mean over test batches of IsoScore* of the "
                                  f"batch's tokens (padding excluded) shrunk with zeta {h.zeta} towards the "
                                  "covariance of all test tokens; the batches are eval_batch_size consecutive test "
                                  "examples, the same on any device count",
        }

    @rank_zero_only
    def write_outputs(self, root: Path, data) -> None:
        """export/ (config.json, model.safetensors, the tokenizer files) and finetune.json, each whole or absent."""
        with staged_output(root / "export", "the export", owner="export", legacy=export_weights) as stage, \
                quiet_transformers():  # no bar (an earlier export's weight files that this one does not write go)
            self.model.save_pretrained(stage)
            self.tokenizer.save_pretrained(stage)
        with staged_output(root) as stage:
            write_json(stage / REPORT, self.report(data))

    def check_checkpoint(self, hparams: dict, what: str = "the checkpoint") -> None:
        """One line when a checkpoint was fine-tuned on other classes than the data give."""
        saved = hparams.get("classes")
        if saved is not None and list(saved) != list(self.hparams.classes):
            raise UserError(f"{what} was fine-tuned on the classes {list(saved)} but the data give "
                            f"{list(self.hparams.classes)}; resume with the same data")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["encoder_commit"] = self.encoder_commit  # the commit the run started from, whatever `main` is later

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.check_checkpoint(checkpoint.get("hyper_parameters", {}))
        if "encoder_commit" in checkpoint:  # a resume: its weights come from the checkpoint, fine-tuned from this one
            self.encoder_commit = checkpoint["encoder_commit"]
        super().on_load_checkpoint(checkpoint)
        data = getattr(self._trainer, "datamodule", None)
        if hasattr(data, "adapt_checkpoint"):  # before Lightning restores its loops from the same dict
            data.adapt_checkpoint(checkpoint)

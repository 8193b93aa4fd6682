"""The isotropy regularisers against direct computations: I-STAR's IsoScore* (value, gradient, C0) and CosReg's R_cos
(Gao et al.'s mean of the cosine matrix), and their effect on a tiny model's states (CPU, seconds).

    .venv/bin/pytest tests/test_regularizers.py -q
"""

from __future__ import annotations

import csv
import itertools
import json
import os

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train
from core.errors import UserError
from datamodules.finetune import FineTuneDataModule
from lightning_modules.finetune import FineTuneModule
from lightning_modules.monitor import StepMonitor
from lightning_modules.regularizers import Regularizer
from metrics.isotropy import IsoScoreStar, isoscore, isoscore_of_covariance, isoscore_star
from tests.test_geometry import isoscore_of_covariance_reference
from tests.tiny import corpus_sentences, save_tiny_encoder

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


def planted_states(seed: int = 0, layers: int = 3, batch: int = 4, seq: int = 9, hidden: int = 12):
    """Hidden states [batch, seq, hidden] per layer, float64, anisotropic (a dimension with a large mean and spread),
    and a padding mask [batch, seq] with rows of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.3, 2.0, hidden, dtype=torch.float64)
    states = []
    for _ in range(layers):
        x = torch.randn(batch, seq, hidden, generator=generator, dtype=torch.float64) * scale
        x[..., 3] = x[..., 3] * 6 + 40  # an outlier dimension: its mean dwarfs its spread
        states.append(x)
    lengths = torch.tensor([9, 5, 7, 2])[:batch]
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return states, mask


def test_isoscore_of_the_covariance_equals_the_eigenvalue_route():
    """IsoScore from tr(C)^2 / ||C||_F^2 (no eigensolver) equals IsoScore from C's eigenvalues (numpy's, step by
    step as Rudman et al. give it) and the eigenvalue route of metrics.isotropy."""
    generator = torch.Generator().manual_seed(1)
    for rows in (3, 40):  # rank-deficient and full rank
        points = torch.randn(rows, 10, generator=generator, dtype=torch.float64) * torch.linspace(0.1, 3, 10)
        cov = torch.cov(points.T)
        reference = isoscore_of_covariance_reference(cov.numpy())
        assert isoscore_of_covariance(cov).item() == pytest.approx(reference, abs=1e-12)
        assert isoscore(cov).item() == pytest.approx(reference, abs=1e-12)


def test_istar_through_autograd_equals_the_metric_and_its_gradient_matches_finite_differences():
    """I-STAR's statistic over the union of three layers' unpadded tokens equals metrics.isotropy.isoscore_star and
    the IsoScoreStar metric of those points (shrunk towards a given C0); its term is weight (1 - IsoScore*), and the
    gradient autograd gives a hidden state equals a central finite difference."""
    states, mask = planted_states()
    generator = torch.Generator().manual_seed(2)
    c0 = torch.cov((torch.randn(500, 12, generator=generator, dtype=torch.float64) * 2).T)
    reg = Regularizer("istar", weight=0.7, zeta=0.3)
    reg.bind(num_layers=3)
    reg.shrinkage = c0
    points = torch.cat([state[mask] for state in states])  # [tokens x layers, hidden]
    term, value = reg(states, mask)
    shrunk = 0.7 * np.cov(points.numpy().T) + 0.3 * c0.numpy()  # C_zeta = (1 - zeta) C + zeta C0, by hand
    assert value.item() == pytest.approx(isoscore_of_covariance_reference(shrunk), abs=1e-12)
    assert value.item() == pytest.approx(isoscore_star(points, 0.3, c0).item(), abs=1e-12)
    metric = IsoScoreStar(1, 12, zeta=0.3, shrinkage=c0)
    metric.update(points.unsqueeze(0))
    assert value.item() == pytest.approx(metric.compute().item(), abs=1e-12)
    assert term.item() == pytest.approx(0.7 * (1 - value.item()), abs=1e-12)
    every = torch.cat([state.flatten(0, 1) for state in states])  # no mask (MLM's full blocks): every token counts
    assert reg(states, None)[1].item() == pytest.approx(isoscore_star(every, 0.3, c0).item(), abs=1e-12)
    leaves = [state.clone().requires_grad_(True) for state in states]
    reg(leaves, mask)[0].backward()
    for layer, (b, s, d) in itertools.product(range(3), [(0, 2, 3), (2, 6, 7), (1, 4, 0)]):
        bumped = [[state.clone() for state in states] for _ in range(2)]
        bumped[0][layer][b, s, d] += 1e-6
        bumped[1][layer][b, s, d] -= 1e-6
        numeric = (reg(bumped[0], mask)[0] - reg(bumped[1], mask)[0]).item() / 2e-6
        assert leaves[layer].grad[b, s, d].item() == pytest.approx(numeric, rel=1e-5, abs=1e-9)
    padded = leaves[0].grad[3, 2:]  # padding never counts: no gradient reaches it
    assert torch.count_nonzero(padded) == 0


def test_cosreg_equals_gao_et_als_cosine_matrix_mean_by_a_direct_computation():
    """CosReg: Gao et al.'s R_cos = 1/N^2 sum_i sum_j cos(h_i, h_j) over the unpadded tokens, the N x N matrix with its
    diagonal (the I-STAR authors' code leaves it out of the sum: 1/N lower), per chosen layer, averaged over the layers (a zero vector counts as
    cosine 0, its diagonal too); the last layer by default. The mean over distinct pairs alone (what CosReg computed
    before) differs by about (1 - that mean) / N: 0.002 here, far above the tolerance."""
    states, mask = planted_states(seed=3)
    states[2][1, 1] = 0.0  # a zero vector among the tokens

    def direct(state, everything=False):
        tokens = state.flatten(0, 1) if everything else state[mask]
        total = 0.0
        for i, j in itertools.product(range(len(tokens)), repeat=2):
            a, b = tokens[i], tokens[j]
            norms = a.norm() * b.norm()
            total += float(a @ b / norms) if norms > 0 else 0.0
        return total / len(tokens) ** 2

    last = Regularizer("cosreg", weight=2.0)
    assert last.bind(num_layers=3) == [3]
    term, value = last([states[2]], mask)
    assert value.item() == pytest.approx(direct(states[2]), abs=1e-12)
    assert last([states[2]], None)[1].item() == pytest.approx(direct(states[2], everything=True), abs=1e-12)
    assert term.item() == pytest.approx(2 * direct(states[2]), abs=1e-12)
    two = Regularizer("cosreg", weight=1.0, layers="1,3")
    assert two.bind(num_layers=3) == [1, 3]
    assert two([states[0], states[2]], mask)[1].item() == pytest.approx((direct(states[0]) + direct(states[2])) / 2,
                                                                         abs=1e-12)
    # the gradient of the term is R_cos's, by central differences on one unpadded token's component
    leaf = states[2].clone().requires_grad_(True)
    last([leaf], mask)[0].backward()
    bumped = [states[2].clone() for _ in range(2)]
    bumped[0][0, 1, 2] += 1e-6
    bumped[1][0, 1, 2] -= 1e-6
    numeric = 2 * (direct(bumped[0]) - direct(bumped[1])) / 2e-6
    assert leaf.grad[0, 1, 2].item() == pytest.approx(numeric, rel=1e-5, abs=1e-9)


def _cosreg_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a 2-process gloo group: CosReg's term on its half of the batch (rows rank, rank + 2, ...) and the
    gradient of its states: every rank's term depends on every rank's states (the all-reduce's backward sums the
    ranks' upstream gradients), so a rank's states get world x their share, which DDP's averaging of the parameters'
    gradients divides by world again."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        states, mask = planted_states(seed=3)
        leaf = states[2][rank::world].clone().requires_grad_(True)
        reg = Regularizer("cosreg", weight=2.0)
        reg.bind(num_layers=3)
        term, value = reg([leaf], mask[rank::world])
        term.backward()
        torch.save({"term": term.detach(), "value": value, "grad": leaf.grad / world}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_cosreg_over_two_processes_equals_one_process_with_the_whole_batch(tmp_path):
    """CosReg under DDP: the unit-vector sums and token counts are all-reduced before R_cos = ||sum u||^2 / N^2, so each
    rank's term and statistic are those of the whole batch, and the gradients (DDP-averaged) equal one process's."""
    from tests.tiny import free_port

    out = str(tmp_path / "cosreg")
    mp.start_processes(_cosreg_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn", join=True)
    states, mask = planted_states(seed=3)
    leaf = states[2].clone().requires_grad_(True)
    reg = Regularizer("cosreg", weight=2.0)
    reg.bind(num_layers=3)
    term, value = reg([leaf], mask)
    term.backward()
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got["value"].item() == pytest.approx(value.item(), abs=1e-12)
        assert got["term"].item() == pytest.approx(term.item(), abs=1e-12)
        torch.testing.assert_close(got["grad"], leaf.grad[rank::2], rtol=1e-9, atol=1e-12)


def labelled_csv(path, count: int = 60):
    """A small labelled file from the bundled corpus: does the line hold a comma."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for line in corpus_sentences(count, start=100):
            writer.writerow([line, "comma" if "," in line else "none"])
    return path


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from tests.tiny import bert_tokenizer

    folder = tmp_path_factory.mktemp("tiny-bert")
    return save_tiny_encoder(folder / "encoder", "bert", bert_tokenizer(folder / "tokenizer"))


def test_c0_equals_a_direct_covariance_of_the_chosen_training_tokens(tiny_bert, tmp_path):
    """C0: the population covariance of the chosen layers' states (their union) over the first examples of the
    epoch's seeded permutation holding up to the token budget (padding excluded), as transformers computes them; the
    ranks' shares make up the same examples, and another epoch draws others."""
    from transformers import AutoModel

    data = FineTuneDataModule(source=str(labelled_csv(tmp_path / "data.csv")), eval_batch_size=4, max_length=32)
    module = FineTuneModule(encoder=str(tiny_bert), classes=data.label_names, regularizer="istar", reg_weight=1.0,
                            reg_layers="1,3")
    data.attach(module.tokenizer, module.max_length)
    budget = 300
    batches = list(data.shrinkage_batches(epoch=0, max_tokens=budget, rank=0, world=1))
    rows = [row for batch in batches for row in batch["attention_mask"]]
    lengths = [int(row.sum()) for row in rows]
    assert sum(lengths) <= budget < sum(lengths) + 40  # the next example would pass the budget (lines are short)
    shares = [list(data.shrinkage_batches(0, budget, rank, 2)) for rank in range(2)]
    ids = {tuple(row[row != 0].tolist()) for batch in batches for row in batch["input_ids"]}
    assert ids == {tuple(row[row != 0].tolist()) for share in shares for batch in share for row in batch["input_ids"]}
    other = {tuple(row[row != 0].tolist()) for batch in data.shrinkage_batches(1, budget, 0, 1)
             for row in batch["input_ids"]}
    assert other != ids
    module.eval()
    module.regularizer.refresh(module.shrinkage_states, batches, 32, torch.device("cpu"), epoch=0)
    plain = AutoModel.from_pretrained(tiny_bert).eval()
    tokens = []
    with torch.no_grad():
        for batch in batches:
            hidden = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           token_type_ids=batch["token_type_ids"], output_hidden_states=True).hidden_states
            tokens += [hidden[layer][batch["attention_mask"].bool()] for layer in (1, 3)]
    expected = torch.cov(torch.cat(tokens).double().T, correction=0)
    torch.testing.assert_close(module.regularizer.shrinkage, expected, rtol=1e-5, atol=1e-7)
    assert module.regularizer.shrinkage_epoch == 0


@pytest.mark.parametrize("weight", [5.0, -5.0])
def test_a_few_steps_of_istar_move_a_tiny_models_isotropy_the_way_its_weight_says(tiny_bert, tmp_path, weight):
    """A tiny BERT with a planted outlier direction (a large LayerNorm bias in every layer: anisotropic states), a
    few training steps of FineTuneModule's own step (cross-entropy + I-STAR, dropout off): with λ > 0 the IsoScore*
    of its states on a fixed batch rises, with λ < 0 it falls."""
    data = FineTuneDataModule(source=str(labelled_csv(tmp_path / "data.csv")), batch_size=16, max_length=32)
    module = FineTuneModule(encoder=str(tiny_bert), classes=data.label_names, regularizer="istar", reg_weight=weight,
                            zeta=0.0, dropout=0.0, lr=3e-3)
    with torch.no_grad():
        for name, parameter in module.model.named_parameters():
            if "LayerNorm.bias" in name:
                parameter[5] += 3.0
    data.attach(module.tokenizer, module.max_length)
    batch = data.sets["train"][list(range(16))]
    module.monitor = StepMonitor(torch.device("cpu"), 0)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)

    def statistic() -> float:
        with torch.no_grad():
            hidden = module(batch, hidden_states=True).hidden_states
        mask = batch["attention_mask"].bool()
        return isoscore_star(torch.cat([hidden[layer][mask] for layer in (1, 2, 3)]), 0.0).item()

    seen = []  # IsoScore* of the weights each step starts from
    for _ in range(5):
        seen.append(statistic())
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()
    before, after = seen[0], statistic()
    assert (after - before) * weight > 0 and abs(after - before) > 0.02, (before, after)
    sums = module.monitor.value_sums  # each step's statistic and term, summed on the device for logging
    assert set(sums) == {"reg_loss", "isoscore_star"}
    assert sums["isoscore_star"].item() == pytest.approx(sum(seen), rel=1e-5)
    assert sums["reg_loss"].item() == pytest.approx(weight * sum(1 - value for value in seen), rel=1e-5)


@pytest.mark.parametrize("options, message", [
    ({"name": "isotropy"}, "--model.regularizer must be one of none, istar, cosreg, got 'isotropy'"),
    ({"name": "istar", "weight": 1.0, "zeta": 1.5}, "--model.zeta must lie in [0, 1], got 1.5"),
    ({"name": "istar", "weight": 1.0, "layers": "2,7"},
     "--model.reg_layers 2,7: layer(s) [7] are outside the model's layers 0..3 (0 = embedding output)"),
    ({"name": "cosreg", "weight": 1.0, "layers": "top"},
     "--model.reg_layers must be all, last or layers such as 4 or 1,3,5, got 'top'"),
    ({"name": "cosreg", "weight": float("nan")}, "--model.reg_weight must be a finite number, got nan"),
    ({"name": "istar", "weight": 1.0, "shrinkage_tokens": 1}, "--model.reg_shrinkage_tokens must be at least 2, got 1"),
])
def test_bad_regulariser_options_are_one_line(options, message):
    with pytest.raises(UserError) as error:
        Regularizer(**options).bind(num_layers=3)
    assert str(error.value) == message


def test_a_regulariser_with_weight_zero_warns_and_changes_nothing():
    states, mask = planted_states(seed=4)
    with pytest.warns(UserWarning, match=r"--model.regularizer istar with --model.reg_weight 0 does not change the "
                                         r"loss: its isoscore_star is computed and logged only"):
        reg = Regularizer("istar", weight=0.0)
    reg.bind(num_layers=3)
    term, value = reg(states, mask)
    assert term.item() == 0.0 and 0 < value.item() < 1
    with pytest.warns(UserWarning, match=r"--model.reg_weight 2 is ignored without a regulariser"):
        assert not Regularizer("none", weight=2.0).on
    assert not Regularizer().on and Regularizer().bind(3) == []  # the default: none, no warning


class ForwardCounter(pl.Callback):
    """Test helper: encoder forward passes during each training micro-batch (not C0's pass at an epoch's start),
    per optimizer step; instances register in `made`."""

    made: list[ForwardCounter] = []

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}
        self.inside = False
        ForwardCounter.made.append(self)

    def on_train_start(self, trainer, pl_module) -> None:
        def count(module, args) -> None:
            if self.inside:
                self.calls[trainer.global_step] = self.calls.get(trainer.global_step, 0) + 1
        pl_module.model.roberta.register_forward_pre_hook(count)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.inside = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.inside = False


@pytest.mark.slow
def test_pretraining_with_istar_compiles_into_one_graph_and_logs_what_the_eager_run_logs(corpus, cache, tmp_path):
    """configs' MLM with I-STAR (λ 0.5) and the outlier callback capturing every 2nd step: one forward per
    micro-batch serves both (the same tap); compiled (--model.compile true) it is one graph, the one returning the
    states with their graph, never recompiled; its loss, I-STAR term and IsoScore* each step equal the eager run's."""
    from torch._dynamo.utils import counters

    from tests.test_train import metrics, tiny_args

    outliers = json.dumps({"class_path": "callbacks.outlier_statistics.OutlierStatistics",
                           "init_args": {"every_n_steps": 2, "image_every_n_steps": 0}})
    counter = json.dumps({"class_path": "tests.test_regularizers.ForwardCounter"})
    common = ("--model.regularizer", "istar", "--model.reg_weight", "0.5", "--model.dropout", "0.0",
              "--model.reg_shrinkage_tokens", "640", "--trainer.max_steps", "6", "--model.decay_steps", "6",
              "--trainer.callbacks+", outliers)
    ForwardCounter.made.clear()
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert train.cli_main(tiny_args(eager, corpus, cache, *common, "--trainer.callbacks+", counter)) == 0
    (made,) = ForwardCounter.made
    assert made.calls == {step: 1 for step in range(6)}  # captured steps (0, 2, 4) too: one forward each
    torch._dynamo.reset()
    counters.clear()  # dynamo's counters outlive reset(): earlier tests' graphs
    assert train.cli_main(tiny_args(compiled, corpus, cache, *common, "--model.compile", "true")) == 0
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]

    def rows(root):
        return {int(r["step"]): {k: float(r[k]) for k in ("train/loss", "train/reg_loss", "train/isoscore_star")}
                for r in metrics(root) if r.get("train/loss")}

    a, b = rows(eager), rows(compiled)
    assert sorted(a) == sorted(b) == list(range(6))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), step


def test_a_resumed_c0_moves_to_the_states_device_once():
    """A checkpoint's C0 is restored before Lightning moves the model to its device (on_load_checkpoint runs with the
    module on the CPU): the first regularised step keeps C0 on the states' device, so later steps copy nothing from
    the host (before, every step of the resumed epoch copied the [hidden, hidden] matrix from the host, waiting for
    the device). The meta device stands in for an accelerator; the value on the CPU is unchanged."""
    states, mask = planted_states(seed=5)
    c0 = torch.cov((torch.randn(300, 12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)).T)
    saved = Regularizer("istar", weight=1.0, zeta=0.3)
    saved.bind(num_layers=3)
    saved.shrinkage, saved.shrinkage_epoch = c0, 0
    reg = Regularizer("istar", weight=1.0, zeta=0.3)
    reg.bind(num_layers=3)
    reg.load_state_dict(saved.state_dict(), torch.device("cpu"))
    expected = isoscore_star(torch.cat([state[mask] for state in states]), 0.3, c0).item()
    assert reg(states, mask)[1].item() == pytest.approx(expected, abs=1e-12)
    points = [state.to("meta").reshape(-1, 12) for state in states]  # as __call__ gives them (no autocast on meta)
    reg._isoscore_star(points, mask.to("meta").reshape(-1, 1).double())
    assert reg.shrinkage.device.type == "meta"

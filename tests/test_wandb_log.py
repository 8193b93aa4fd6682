"""The offline W&B log reader the callback tests rely on: what a run logged is what the reader returns."""

from __future__ import annotations

import numpy as np
import wandb

from tests.wandb_log import read_run


def test_reader_returns_logged_history_summary_metrics_and_media(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = wandb.init(project="reader-test", dir=str(tmp_path), config={"lr": 0.5}, name="arm/seed0", job_type="probe",
                     group="arm", tags=["a", "b"])
    run.define_metric("trainer/global_step")
    run.define_metric("outliers/*", step_metric="trainer/global_step")
    values = [0.25 * i for i in range(40)]
    for step, value in enumerate(values):
        run.log({"outliers/share": value, "trainer/global_step": step, "blob": "x" * 3000})  # spans blocks
    run.log({"figure": wandb.Image(np.zeros((4, 4, 3), dtype=np.uint8))})
    run.summary["final"] = 7
    run.finish()
    (directory,) = (tmp_path / "wandb").glob("offline-run-*")
    read = read_run(directory)
    assert read.values("outliers/share") == values
    assert read.values("trainer/global_step") == list(range(40))
    assert read.summary["final"] == 7 and read.summary["outliers/share"] == values[-1]
    assert read.metrics["outliers/*"] == "trainer/global_step"
    assert read.config["lr"] == 0.5
    assert (read.name, read.job_type, read.group, read.tags) == ("arm/seed0", "probe", "arm", ["a", "b"])
    assert [p.suffix for p in read.media if p.is_file()] == [".png"]

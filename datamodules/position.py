"""Where the training data stands, saved in every checkpoint and restored on `--ckpt_path last`, exactly.

    position = DataPosition(batch_size=16, global_batch_size=256, streaming=False)
    resume = position.begin(world)                  # train_dataloader: where this loader starts
    epoch, skip = position.begin_epochs(resume, epoch_blocks)   # cached blocks: the sampler's epoch and batches to skip
    position.advance(stream_state)                  # after each training batch a step consumes
    state = position.state(world, rank)             # the checkpoint's "position" (and streaming: every rank's stream)
    position.restore(state, rank, world)            # load_state_dict; check(state, world) refuses what cannot continue

The position is counted in global blocks (micro-batches × batch_size × world size), with the epoch and the blocks
into it, the world size, batch size and global batch, so a run resumes on another device count too whenever the
global batch is unchanged (a step then sees the same blocks). A streaming run saves every rank's stream state
instead (each of its shards, one per loader worker: texts skipped unread on resume, one chunk re-tokenised) and
resumes on its own device count and worker count only.
"""

from __future__ import annotations

from core.errors import UserError


class DataPosition:
    """The data position after the last training batch consumed (see the module docstring)."""

    def __init__(self, batch_size: int, global_batch_size: int | None, streaming: bool, workers: int = 1) -> None:
        self.batch_size, self.global_batch_size, self.streaming = batch_size, global_batch_size, streaming
        self.workers = max(1, workers)  # streaming: shards of the stream per rank (loader workers)
        self.pending: dict | None = None  # a checkpoint's position, converted to this run (restore)
        self.current: dict | None = None  # {"blocks", "epoch", "in_epoch"} after the last training batch consumed
        self.stream: dict | None = None  # streaming: this rank's stream state after that batch
        self.step = self.epoch_blocks = 0  # blocks per training micro-batch over all ranks; per epoch

    def global_batch(self, world_size: int) -> int:
        """Blocks per optimizer step over all ranks: --data.global_batch_size, else batch_size × world size."""
        return self.global_batch_size or self.batch_size * world_size

    def accumulation(self, world_size: int) -> int:
        """Gradient-accumulation steps that keep the global batch: global / (batch_size × world size)."""
        if self.global_batch_size is None:
            return 1
        per_step = self.batch_size * world_size
        if self.global_batch_size % per_step:
            raise UserError(f"global batch {self.global_batch_size} is not a multiple of batch_size {self.batch_size} "
                            f"× {world_size} devices; choose --data.batch_size so that it divides")
        return self.global_batch_size // per_step

    def check_trainer(self, trainer, apply: bool = True) -> None:
        """The trainer's accumulation against the global batch's (set on the trainer when `apply`)."""
        accumulate = self.accumulation(trainer.world_size)
        if trainer.accumulate_grad_batches not in (1, accumulate):
            raise UserError(f"--trainer.accumulate_grad_batches {trainer.accumulate_grad_batches} contradicts "
                            f"--data.global_batch_size (which needs {accumulate}); set only the global batch")
        if apply:
            trainer.accumulate_grad_batches = accumulate

    # -- the training loader --

    def begin(self, world: int) -> dict:
        """Where a new training loader starts: a checkpoint's position, else where this run stands (a loader made
        again goes on from there). Returns {"blocks", "epoch", "in_epoch", "stream"} (missing keys: the start)."""
        resume, self.pending = self.pending or {**(self.current or {}), "stream": self.stream}, None
        self.step = self.batch_size * world
        self.current = {"blocks": int(resume.get("blocks", 0)), "epoch": 0, "in_epoch": 0}
        if self.streaming:
            self.stream = resume.get("stream")
        return resume

    def begin_epochs(self, resume: dict, epoch_blocks: int) -> tuple[int, int]:
        """(epoch, micro-batches to skip in it) for cached blocks with `epoch_blocks` blocks per epoch."""
        self.epoch_blocks = epoch_blocks
        epoch, in_epoch = int(resume.get("epoch", 0)), int(resume.get("in_epoch", 0))
        if in_epoch >= epoch_blocks:  # another global batch than the checkpoint's: this epoch is used up
            epoch, in_epoch = epoch + 1, 0
        self.current.update(epoch=epoch, in_epoch=in_epoch)
        return epoch, in_epoch // self.step

    def advance(self, stream_state: dict | None) -> None:
        """One training micro-batch consumed (over all ranks); `stream_state`: where a streaming rank stands now."""
        if self.current is None:
            return
        if stream_state is not None:
            self.stream = merge_stream_state(self.stream, stream_state, self.workers)
        current = self.current
        current["blocks"] += self.step
        current["in_epoch"] += self.step
        if self.epoch_blocks and current["in_epoch"] >= self.epoch_blocks:
            current["epoch"], current["in_epoch"] = current["epoch"] + 1, 0

    # -- checkpoints --

    def state(self, world: int) -> dict:
        """{"position": ...} for the checkpoint, and for streaming {"stream": every rank's state} (a collective:
        Lightning saves on every rank)."""
        if self.current is None:
            return {}
        state = {"position": {**self.current, "world": world, "batch_size": self.batch_size,
                              "global_batch": self.global_batch(world), "streaming": self.streaming}}
        if self.streaming:
            state["position"]["workers"] = self.workers
            state["stream"] = gather_objects(self.stream, world)
        return state

    def restore(self, state: dict, rank: int, world: int) -> None:
        """Take a checkpoint's position, converted to this run's devices (checked first)."""
        self.check(state, world)
        position = state.get("position")
        if not position:
            return
        if "world" in position:
            self.pending = {key: position[key] for key in ("blocks", "epoch", "in_epoch")}
            if self.streaming:
                self.pending["stream"] = state["stream"][rank]
            return
        # a checkpoint from before the position was global: micro-batches of this rank, same devices assumed
        batches, per_epoch = int(position["batches"]), int(position["per_epoch"]) or 1
        step = self.batch_size * world
        self.pending = {"blocks": batches * step, "epoch": batches // per_epoch, "in_epoch": batches % per_epoch * step}
        if self.streaming:
            self.pending["stream"] = {"epoch": 0, "text": 0, "carry": [], "done": batches * self.batch_size,
                                      "counter": 0}

    def check(self, state: dict, world: int, source: str = "the checkpoint") -> None:
        """One clear line (naming `source`) when a checkpoint's data position cannot continue on `world` devices with
        this config.

        The cached path converts exactly whenever the global batch is unchanged (a step sees the same blocks on any
        device count), and another global batch is refused (checkpoints from before it was saved are not checked);
        a streaming run interleaves the texts by rank, so it resumes only on its own device count.
        """
        position = (state or {}).get("position") or {}
        if "world" not in position:
            return
        if position["streaming"] != self.streaming:
            raise UserError(f"{source} is of a run with --data.streaming {str(position['streaming']).lower()}; "
                            f"resume with the same setting (the config gives {str(self.streaming).lower()})")
        if self.streaming and position["world"] != world:
            raise UserError(f"cannot resume a streaming run saved at world size {position['world']} at world size "
                            f"{world} (devices × nodes; each rank reads its own share of the texts): resume with "
                            f"world size {position['world']}")
        if self.streaming and position.get("workers", 1) != self.workers:
            raise UserError(f"cannot resume a streaming run read by {position.get('workers', 1)} loader workers per "
                            f"rank with --data.num_workers giving {self.workers} (each worker reads its own shard of "
                            f"the texts): resume with --data.num_workers {position.get('workers', 1)}")
        saved, current = position.get("global_batch"), self.global_batch(world)
        if saved is not None and saved != current:
            raise UserError(f"cannot resume: {source} was trained with global batch {saved} but the config gives "
                            f"{current}; keep the run's global batch (--data.global_batch_size {saved})")
        step = self.batch_size * world
        if position["blocks"] % step or position["in_epoch"] % step:
            raise UserError(f"cannot resume: {source} stopped after {position['blocks']} blocks, not a multiple "
                            f"of --data.batch_size {self.batch_size} × {world} devices; keep the run's global batch")

    def adapt(self, state: dict, checkpoint: dict, world: int) -> None:
        """Express Lightning's saved micro-batch counts in this run's micro-batches when batch_size × world size
        changed (before Lightning restores its loops from the same checkpoint), so that accumulation windows, epoch
        ends and dropout seeds continue from the same blocks."""
        position = (state or {}).get("position") or {}
        if "world" not in position:
            return
        self.check(state, world)
        old, new = position["batch_size"] * position["world"], self.batch_size * world
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if old == new or not progress:
            return
        for counts in (progress["total"], progress["current"]):
            shift = counts["processed"] * old // new - counts["processed"]  # keeps Lightning's restart pattern
            for key in ("ready", "started", "processed", "completed"):
                counts[key] += shift


def gather_objects(value, world: int) -> list:
    """[value of rank 0, value of rank 1, ...] (a collective: every rank calls it)."""
    import torch.distributed as dist

    if world > 1 and dist.is_available() and dist.is_initialized():
        values = [None] * world
        dist.all_gather_object(values, value)
        return values
    return [value]


# ---- a streaming rank's state: one per shard (loader worker) ----

def fresh_state() -> dict:
    return {"epoch": 0, "text": 0, "carry": [], "done": 0, "counter": 0}


def stream_start(state: dict | None, workers: int) -> dict:
    """A rank's stream state {"shards": [...], "next"} from a saved one (None: the start; a single shard's state, as
    checkpoints from before the shards held: shard 0 of one)."""
    if not state:
        return {"shards": [None] * workers, "next": 0}
    if "shards" not in state:
        state = {"shards": [state], "next": 0}
    if len(state["shards"]) != workers:
        raise UserError(f"the stream was read by {len(state['shards'])} loader workers per rank, this run has "
                        f"{workers}: resume with --data.num_workers {len(state['shards'])}")
    return state


def merge_stream_state(state: dict | None, batch_state: dict, workers: int) -> dict:
    """The rank's stream state once a batch of shard `batch_state["shard"]` is consumed: that shard's state replaced,
    and the next batch comes from the next shard."""
    state = stream_start(state, workers)
    shard = int(batch_state.get("shard", 0))
    shards = list(state["shards"])
    shards[shard] = {key: value for key, value in batch_state.items() if key != "shard"}
    return {"shards": shards, "next": (shard + 1) % workers}

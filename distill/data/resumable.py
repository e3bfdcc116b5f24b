"""Training data that resumes mid-epoch where an interrupted run stopped, instead of replaying the
epoch's start.

Lightning stores ``state_dict()`` of a training DataLoader that has one in each checkpoint and hands
it back through ``load_state_dict`` before the first iterator of a resumed run is made. The state
here is the number of batches the epoch had consumed, computed from the optimizer step count (not
from batches fetched, which runs one ahead because Lightning prefetches); the batch order is a fixed
seeded permutation, so skipping that many batches reproduces the uninterrupted run exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler


class ResumableSampler(DistributedSampler):
    """Items ``rank, rank + world, ...`` in order (no shuffle); after :meth:`skip_next`, the next
    pass starts later.

    A DistributedSampler subclass so that Lightning keeps it under DDP instead of wrapping it in its
    own.
    """

    def __init__(self, size: int, rank: int = 0, world: int = 1) -> None:
        super().__init__(range(size), num_replicas=world, rank=rank, shuffle=False, drop_last=False)
        self._skip = 0

    @classmethod
    def for_trainer(cls, size: int, trainer: Any) -> ResumableSampler:
        """Keep the seeded order; under data parallelism deal item r, r+W, ... to rank r of
        ``trainer`` (None: one process).

        Lightning's automatic distributed sampler reshuffles, which would break the property that W
        processes see the same global batches as one process with W-step gradient accumulation.
        """
        world = int(getattr(trainer, "world_size", 1) or 1)
        return cls(size, rank=int(trainer.global_rank) if world > 1 else 0, world=world)

    def skip_next(self, items: int) -> None:
        """Leave out the first ``items`` of the next pass only (a resumed epoch)."""
        self._skip = max(0, int(items))

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class ResumableLoader(DataLoader):
    """A training DataLoader over a :class:`ResumableSampler` whose epoch position is saved in
    checkpoints.

    ``batches_done`` returns how many batches of the current epoch the trainer has consumed;
    ``items_per_batch`` is how many sampler items make one batch (1 when the dataset yields whole
    batches).
    """

    def __init__(
        self, *args: Any, batches_done: Callable[[], int], items_per_batch: int, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler):
            raise TypeError("ResumableLoader needs a ResumableSampler")
        self._batches_done = batches_done
        self._items_per_batch = items_per_batch

    def state_dict(self) -> dict[str, int]:
        """The epoch position to store in a checkpoint."""
        return {"batches_done_in_epoch": int(self._batches_done())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skip what the interrupted epoch had already consumed (next pass only)."""
        self.sampler.skip_next(int(state.get("batches_done_in_epoch", 0)) * self._items_per_batch)


def batches_done_in_epoch(global_step: int, batches_per_epoch: int | float, accumulate: int) -> int:
    """Batches of the current epoch behind ``global_step`` optimizer steps (an epoch of N batches
    takes ceil(N / accumulate) steps; its last step may use fewer batches)."""
    if not math.isfinite(batches_per_epoch) or batches_per_epoch <= 0:
        return 0
    steps_per_epoch = math.ceil(batches_per_epoch / accumulate)
    return min(int(batches_per_epoch), (global_step % steps_per_epoch) * accumulate)

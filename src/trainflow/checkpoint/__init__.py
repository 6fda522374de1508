"""torch.distributed.checkpoint of the whole training state: committed or absent, resumable on any world size.

What is saved (FSDP/DDP-aware via get_state_dict/set_state_dict): the model and optimizer tensors as DCP shards;
as JSON beside them (nothing is pickled, nothing loaded runs code) the optimizer's type and hyperparameters, the
LR scheduler, step, samples_seen (the position in data/stream.py's world-size-independent sample stream), and the RNG
state of every rank (torch CPU and CUDA, Python, NumPy), one file per rank.

One module per concern:

    state.py         the app state: what goes into a checkpoint (tensors and JSON), non-finite check, fingerprint
    safe_io.py       the bytes: raw tensor records, a checksum per file while writing, reading without running code
    store.py         the on-disk store: lock, committed listing, manifest, integrity, commit, retention
    export.py        weights out of a checkpoint in other formats (torch, safetensors, Hugging Face, stock DCP)
    resume.py        which checkpoint to resume from, whether it fits, loading it
    checkpointer.py  the Checkpointer the loop calls: saving (sync, async), resume
    stopping.py      stop signals: caught, agreed on by every rank one step late, the exit code after
    agreement.py     every rank reaches the same decision or raises the same error
    staging.py       async saves: the CPU buffers the state is copied into
"""

from trainflow.checkpoint.checkpointer import Checkpointer
from trainflow.checkpoint.export import export_weights
from trainflow.checkpoint.state import fingerprint, split_state
from trainflow.checkpoint.stopping import EXIT_STOPPED, stop_exit_code
from trainflow.checkpoint.store import check_intact, list_committed
from trainflow.loop.state import TrainState  # what a checkpoint saves: the run's state

__all__ = ["EXIT_STOPPED", "Checkpointer", "TrainState", "check_intact", "export_weights", "fingerprint",
           "list_committed", "split_state", "stop_exit_code"]

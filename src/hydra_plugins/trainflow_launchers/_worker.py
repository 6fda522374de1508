"""One rank of a torchrun-launched sweep job: `python -m hydra_plugins.trainflow_launchers._worker JOB.pkl`.

The launcher pickled the job (composed config, task function, Hydra's global
state); every rank unpickles it and runs the job as Hydra would. Local rank 0
leaves its JobReturn next to the pickle for the launcher of its node (the one
of global rank 0 holds the job's return value). A failed job exits non-zero
so that the elastic agent sees it (and restarts the group if it may).
(The leading underscore keeps Hydra's plugin scan from importing this module.)

torch loads here only when the job needs it (a trainflow job, or a task function
that imports it): the elastic agent's error file, which torch's `record` writes, is
written by torch's handler only once a rank fails under the agent.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobStatus, setup_globals

from hydra_plugins.trainflow_launchers.common import RESULT_NAME, JobFailed, run_job_here
from trainflow.util.failures import recorded
from trainflow.util.files import write_atomic


def main(spec_path: str) -> None:
    spec = Path(spec_path)
    hydra_context, task_function, job, singleton_state = cloudpickle.loads(spec.read_bytes())
    setup_globals()
    Singleton.set_state(singleton_state)
    ret = run_job_here(hydra_context, task_function, job)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            data = cloudpickle.dumps(ret)
        except Exception:  # an exception that does not pickle still comes back as its message
            error = ret._return_value
            ret.return_value = JobFailed(f"{type(error).__name__}: {error}")
            data = cloudpickle.dumps(ret)
        write_atomic(spec.with_name(RESULT_NAME), data)
    if ret.status == JobStatus.FAILED:
        if recorded(ret._return_value):
            raise SystemExit(1)  # its record (time, step) is in the error file already: torch's would overwrite it
        raise ret._return_value


def main_recorded(spec_path: str) -> None:
    """`main`, its failure recorded for the elastic agent as torch's `record` does (a crash's traceback on stderr;
    an exception in the rank's error file, when the agent gave it one)."""
    faulthandler.enable(all_threads=True)
    try:
        main(spec_path)
    except SystemExit:
        raise
    except Exception as exc:
        if "TORCHELASTIC_ERROR_FILE" in os.environ:
            # lazy: torch loads only for a failed rank under the agent; a job that needs no torch never pays it
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(exc)
        raise


if __name__ == "__main__":
    main_recorded(sys.argv[1])

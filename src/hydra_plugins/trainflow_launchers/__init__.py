"""trainflow's Hydra launchers, for trainflow and any other Hydra app: `hydra/launcher=process` (a fresh process per
job), `hydra/launcher=torchrun` (elastic agent per job), `hydra/launcher=slurm` (submitit), `hydra/launcher=ray` (a
gang of ranks per job on a Ray cluster) and `hydra/launcher=kubernetes` (a Kubeflow Trainer TrainJob per job).

Hydra finds the launcher classes by scanning the `hydra_plugins` namespace
package; importing this package registers their configs in the ConfigStore.
The scan executes each module before it is in `sys.modules`, which breaks
dataclasses under `from __future__ import annotations`: the modules that
define dataclasses here (config, common, ray_launcher) do without it.
"""

from hydra_plugins.trainflow_launchers.config import register_configs

register_configs()
